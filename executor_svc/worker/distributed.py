"""The torch.distributed process group of one executor set (the tensor-parallel ranks of a model).

Where a rank learns its place, first match wins:

    rank        --rank | POD_NAME's ordinal when PAGEDSERVE_RANK_FROM_POD_NAME=1 | RANK
                | LWS_WORKER_INDEX x LOCAL_WORLD_SIZE + LOCAL_RANK   (each absent: 0, 1, 0)
    world size  --world-size (alias --tensor-parallel-size) | WORLD_SIZE
                | LWS_GROUP_SIZE x LOCAL_WORLD_SIZE                   (each absent: 1)
    rendezvous  --dist-init-addr HOST:PORT | MASTER_ADDR:MASTER_PORT
                | LWS_LEADER_ADDRESS:MASTER_PORT (29500 when absent)  (rank 0 listens there)

A StatefulSet pod `pagedserve-executor-3` is rank 3. A LeaderWorkerSet (LWS, the Kubernetes API for
multi-host groups) gives each pod of a group LWS_WORKER_INDEX (the leader is 0), LWS_GROUP_SIZE (pods)
and LWS_LEADER_ADDRESS; a pod that runs LOCAL_WORLD_SIZE ranks (executor_svc/server/group.py, one per
GPU) numbers them LOCAL_RANK 0.. , so pod p's ranks are p x LOCAL_WORLD_SIZE + 0.. and the leader's
rank 0 holds the rendezvous. The backend is NCCL on GPU, gloo on CPU. On GPU a rank uses device
LOCAL_RANK (when set) or rank % visible GPUs, so ranks on one machine take one GPU each and a pod
that sees one GPU uses it.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

RANK_FROM_POD_NAME = "PAGEDSERVE_RANK_FROM_POD_NAME"
DEFAULT_RENDEZVOUS_PORT = 29500  # with LWS_LEADER_ADDRESS and no MASTER_PORT
_ORDINAL = re.compile(r"-(\d+)$")


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    rank: int
    world_size: int
    init_addr: str | None  # HOST:PORT of rank 0's rendezvous store; None when world_size == 1
    timeout_s: float = 300.0  # a collective waiting longer than this fails (a rank died)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if self.world_size > 1 and not self.init_addr:
            raise ValueError(
                "a world size over 1 needs a rendezvous: --dist-init-addr HOST:PORT, or MASTER_ADDR and "
                "MASTER_PORT"
            )
        if self.init_addr and not re.fullmatch(r".+:\d+", self.init_addr):
            raise ValueError(f"rendezvous address must be HOST:PORT, got {self.init_addr!r}")


def rank_from_pod_name(pod_name: str) -> int:
    """The StatefulSet ordinal: `pagedserve-executor-3` -> 3."""
    match = _ORDINAL.search(pod_name)
    if match is None:
        raise ValueError(f"{RANK_FROM_POD_NAME}=1 but POD_NAME {pod_name!r} does not end in -<ordinal>")
    return int(match.group(1))


def resolve_distributed(
    rank: int | None,
    world_size: int | None,
    init_addr: str | None,
    timeout_s: float = 300.0,
    environ: Mapping[str, str] = os.environ,
) -> DistributedConfig:
    """Flags (None: not given) completed from the environment, in the order of the module docstring."""
    local_world_size = _env_int(environ, "LOCAL_WORLD_SIZE", 1)
    if rank is None:
        if environ.get(RANK_FROM_POD_NAME) == "1":
            rank = rank_from_pod_name(environ.get("POD_NAME", ""))
        elif "RANK" in environ:
            rank = _env_int(environ, "RANK", 0)
        else:
            pod_index = _env_int(environ, "LWS_WORKER_INDEX", 0)
            rank = pod_index * local_world_size + _env_int(environ, "LOCAL_RANK", 0)
    if world_size is None:
        if "WORLD_SIZE" in environ:
            world_size = _env_int(environ, "WORLD_SIZE", 1)
        else:
            world_size = _env_int(environ, "LWS_GROUP_SIZE", 1) * local_world_size
    if init_addr is None and world_size > 1:
        init_addr = rendezvous_from_env(environ)
    return DistributedConfig(rank, world_size, init_addr if world_size > 1 else None, timeout_s)


def pod_ranks(world_size: int, environ: Mapping[str, str] = os.environ) -> range:
    """The ranks of a set of `world_size` that one pod runs (executor_svc/server/group.py): all of
    them, or under a LeaderWorkerSet an equal share per pod (LWS_GROUP_SIZE pods, this one
    LWS_WORKER_INDEX, the leader 0)."""
    num_pods = _env_int(environ, "LWS_GROUP_SIZE", 1)
    pod_index = _env_int(environ, "LWS_WORKER_INDEX", 0)
    if num_pods < 1 or world_size % num_pods:
        raise ValueError(f"world size {world_size} does not split evenly over LWS_GROUP_SIZE={num_pods} pods")
    if not 0 <= pod_index < num_pods:
        raise ValueError(f"LWS_WORKER_INDEX={pod_index} outside LWS_GROUP_SIZE={num_pods}")
    per_pod = world_size // num_pods
    return range(pod_index * per_pod, (pod_index + 1) * per_pod)


def rendezvous_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """HOST:PORT of rank 0's rendezvous from MASTER_ADDR / MASTER_PORT, or LWS_LEADER_ADDRESS (None:
    neither is set)."""
    host = environ.get("MASTER_ADDR") or environ.get("LWS_LEADER_ADDRESS")
    if not host:
        return None
    port = environ.get("MASTER_PORT") or ("" if environ.get("MASTER_ADDR") else str(DEFAULT_RENDEZVOUS_PORT))
    return f"{host}:{port}" if port else None


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer") from None


def rank_device(device: str | None, rank: int, environ: Mapping[str, str] = os.environ) -> str:
    """The device string this rank runs on ("cpu", "cuda:N"); selects the GPU as current device."""
    import torch  # here, not at import: the launcher reads this module's config without torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda:"):  # named explicitly
        torch.cuda.set_device(torch.device(device))
        return device
    if device != "cuda":
        return device
    index = int(environ["LOCAL_RANK"]) if "LOCAL_RANK" in environ else rank % torch.cuda.device_count()
    torch.cuda.set_device(index)  # Triton launches on the current device
    return f"cuda:{index}"


def init_process_group(config: DistributedConfig, device: str) -> None:
    """Joins the executor set's process group (blocks until every rank has joined)."""
    if config.world_size == 1:
        return
    import torch

    kwargs: dict[str, torch.device] = {}
    if device.startswith("cuda"):
        kwargs["device_id"] = torch.device(device)
    torch.distributed.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        init_method=f"tcp://{config.init_addr}",
        rank=config.rank,
        world_size=config.world_size,
        timeout=datetime.timedelta(seconds=config.timeout_s),
        **kwargs,  # type: ignore[arg-type]  # device_id only
    )
