from protos.pagedserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model_name", "family", "rank", "world_size", "vocab_size", "max_model_len", "num_layers", "num_heads", "num_kv_heads", "head_dim", "block_size", "num_gpu_blocks", "num_cpu_blocks", "eos_token_ids", "dtype", "device", "bos_token_id", "hidden_size")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    family: str
    rank: int
    world_size: int
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    bos_token_id: int
    hidden_size: int
    def __init__(self, model_name: _Optional[str] = ..., family: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., bos_token_id: _Optional[int] = ..., hidden_size: _Optional[int] = ...) -> None: ...

class InitCacheRequest(_message.Message):
    __slots__ = ("num_gpu_blocks", "num_cpu_blocks")
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_gpu_blocks: int
    num_cpu_blocks: int
    def __init__(self, num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ...) -> None: ...

class InitCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_computed_tokens", "num_new_tokens", "block_table", "sampling", "sample_index", "prompt_len")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParameters
    sample_index: int
    prompt_len: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParameters, _Mapping]] = ..., sample_index: _Optional[int] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class ContinuingSequences(_message.Message):
    __slots__ = ("seq_ids", "num_new_tokens", "new_token_count", "new_token_ids", "block_table_start", "block_count", "block_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_token_count: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_table_start: _containers.RepeatedScalarFieldContainer[int]
    block_count: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., new_token_count: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., block_table_start: _Optional[_Iterable[int]] = ..., block_count: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockPairs(_message.Message):
    __slots__ = ("pairs",)
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    pairs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pairs: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_seqs", "cont_seqs", "forks", "finished_seq_ids", "swap_out", "swap_in", "copies", "decode_seq_ids", "decode_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    CONT_SEQS_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    cont_seqs: ContinuingSequences
    forks: _containers.RepeatedScalarFieldContainer[int]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    swap_out: BlockPairs
    swap_in: BlockPairs
    copies: BlockPairs
    decode_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., cont_seqs: _Optional[_Union[ContinuingSequences, _Mapping]] = ..., forks: _Optional[_Iterable[int]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., swap_out: _Optional[_Union[BlockPairs, _Mapping]] = ..., swap_in: _Optional[_Union[BlockPairs, _Mapping]] = ..., copies: _Optional[_Union[BlockPairs, _Mapping]] = ..., decode_seq_ids: _Optional[_Iterable[int]] = ..., decode_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "seq_ids", "token_ids", "logprobs", "num_top", "top_token_ids", "top_logprobs", "num_beam_candidates", "beam_token_ids", "beam_logprobs", "execute_time_s")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    BEAM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEAM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_beam_candidates: _containers.RepeatedScalarFieldContainer[int]
    beam_token_ids: _containers.RepeatedScalarFieldContainer[int]
    beam_logprobs: _containers.RepeatedScalarFieldContainer[float]
    execute_time_s: float
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_top: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., num_beam_candidates: _Optional[_Iterable[int]] = ..., beam_token_ids: _Optional[_Iterable[int]] = ..., beam_logprobs: _Optional[_Iterable[float]] = ..., execute_time_s: _Optional[float] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
