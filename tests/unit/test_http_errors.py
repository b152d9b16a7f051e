"""The HTTP API's 400 for a body that fails its schema (scheduler_svc/frontend/http_errors.py): it
names the field, and of a union's failures (a prompt: text, texts, token ids, lists of them) the one
that says what is wrong. Bodies are typed strictly, as OpenAI's schema types them."""

import pydantic
import pytest

from scheduler_svc.frontend.http_errors import http_error
from scheduler_svc.frontend.openai_schema import ChatCompletionRequest, CompletionRequest

CASES = [  # (extra fields of a completion, the param named, words of the message)
    ({"prompt": [5, -1]}, "prompt.1", "greater than or equal to 0"),  # a value, not a type
    ({"prompt": [1, "2"]}, "prompt.1", "valid integer"),  # token ids with a text: not "valid string"
    ({"prompt": ["a", 2]}, "prompt.1", "valid string"),  # texts with a number
    ({"prompt": ["a", "b", 3.5]}, "prompt.2", "valid string"),  # the member with the fewest errors
    ({"prompt": [1.5]}, "prompt.0", "valid integer"),  # a number where a token id goes
    ({"prompt": [[1], [2, "x"]]}, "prompt.1.1", "valid integer"),
    ({"prompt": {"a": 1}}, "prompt", "a text, a list of texts, a list of token ids or a list of token-id"),
    ({"prompt": 5}, "prompt", "a list of token ids"),
    ({"prompt": [True]}, "prompt.0", "valid integer"),
    ({"max_tokens": "5"}, "max_tokens", "valid integer"),  # no coercion of a string
    ({"max_tokens": True}, "max_tokens", "valid integer"),  # nor of a boolean
    ({"max_tokens": 5.0}, "max_tokens", "valid integer"),
    ({"stream": 1}, "stream", "valid boolean"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"seed": 2**70}, "seed", "less than or equal to"),
    ({"stop": ["a", 1]}, "stop.1", "valid string"),
]


@pytest.mark.parametrize(("fields", "param", "words"), CASES)
def test_a_completion_body_that_fails_names_the_field_that_is_wrong(fields, param, words):
    body = {"model": "m", "prompt": "Hi", **fields}
    with pytest.raises(pydantic.ValidationError) as caught:
        CompletionRequest.model_validate(body)
    err = http_error(caught.value)
    assert err.status == 400 and err.param == param, (fields, err.message)
    assert err.message.startswith(f"{param}: ") and words in err.message, err.message


def test_json_numbers_where_floats_go_and_good_bodies_pass():
    body = CompletionRequest.model_validate_json(
        b'{"model": "m", "prompt": [[1, 2], [3]], "temperature": 1, "top_p": 1, "seed": -5, "n": 2,'
        b' "stream": true, "stream_options": {"include_usage": true}, "logprobs": 2, "stop": ["a"]}')
    assert body.temperature == 1.0 and body.prompts() == [[1, 2], [3]]
    chat = ChatCompletionRequest.model_validate_json(
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],'
        b' "logprobs": true, "top_logprobs": 2, "max_completion_tokens": 3, "tool_choice": "auto"}')
    assert chat.output_limit() == 3 and chat.messages[0].text() == "x"
    with pytest.raises(pydantic.ValidationError) as caught:
        ChatCompletionRequest.model_validate_json(
            b'{"model": "m", "messages": [{"role": "user", "content": 5}]}')
    assert http_error(caught.value).param == "messages.0.content"


def test_a_request_that_outgrew_the_kv_cache_is_a_400_naming_n_other_aborts_a_500():
    """n samples that together outgrew the cache: the client's to change (a 500 was retried twice by
    the SDKs); another ABORTED (processing raised) stays a server error."""
    from scheduler_svc.wire.errors import OUTGREW_KV_CACHE, RelayedError

    err = http_error(RelayedError("ABORTED", OUTGREW_KV_CACHE))
    assert err.status == 400 and err.param == "n" and "fewer samples" in err.message
    assert http_error(RelayedError("ABORTED", "processing the request raised KeyError")).status == 500
