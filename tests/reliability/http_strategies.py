"""Hypothesis strategies for HTTP bodies and headers of the OpenAI endpoints (worker and proxy).

Valid bodies, bodies with one or two fields set to hostile values (wrong types, huge and
negative numbers, NaN, unicode edge cases including lone surrogates, client
``kv_transfer_params`` in both dialects), fully random JSON, and raw malformed bytes.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from tests.conftest import free_port

_EDGE_TEXT = st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "\ud800",  # lone surrogate: valid JSON escape, not encodable as UTF-8
        "\udfff\ud800",
        "\U0010ffff",
        "e\u0301",
        "\u202e RTL",
        "\ufeffBOM",
        "😀" * 30,
        "a" * 3000,
        "<|assistant|>\n",
        "data: [DONE]\n\n",
    ]
)
_TEXT = st.one_of(_EDGE_TEXT, st.text(max_size=40))
_NUMBER = st.one_of(
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 5e-324, 0.5, 2.000001]),
)
_SCALAR = st.one_of(st.none(), st.booleans(), _NUMBER, _TEXT)
JSON_VALUE = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)),
    max_leaves=12,
)


def _closed_port() -> int:
    return free_port()  # bound and released: nothing listens there


_PORT = st.one_of(st.sampled_from([-1, 0, 1, 65535, 65536, 2**40]), st.just(_closed_port()))
_HOST = st.sampled_from(["127.0.0.1", "", " ", "::1", "256.0.0.1", "no.such.host.invalid"])
_KV_ID = st.one_of(st.none(), _TEXT, st.integers(), st.just("0" * 32))
_KV_PARAMS = st.one_of(
    JSON_VALUE,
    st.fixed_dictionaries(
        {"remote_decoder": st.one_of(JSON_VALUE, st.fixed_dictionaries({"kv_request_id": _KV_ID}))}
    ),
    st.fixed_dictionaries(
        {
            "remote_prefiller": st.one_of(
                JSON_VALUE,
                st.fixed_dictionaries(
                    {"kv_request_id": _KV_ID, "remote_host": _HOST, "remote_port": _PORT}
                ),
            )
        }
    ),
    st.fixed_dictionaries(
        {
            "do_remote_decode": st.one_of(st.booleans(), _SCALAR),
            "do_remote_prefill": st.one_of(st.booleans(), _SCALAR),
            "remote_engine_id": st.one_of(st.none(), _TEXT),
            "remote_request_id": _KV_ID,
            "remote_block_ids": st.one_of(st.none(), st.lists(_NUMBER, max_size=4), _SCALAR),
            "remote_host": st.one_of(st.none(), _HOST),
            "remote_port": st.one_of(st.none(), _PORT),
            "tp_size": st.one_of(st.just(1), _NUMBER),
        }
    ),
)
_SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just("kvtier-sim"), _SCALAR),
    "max_tokens": st.one_of(st.integers(1, 8), _NUMBER, _SCALAR),
    "temperature": st.one_of(st.sampled_from([0, 0.7, 2]), _NUMBER, _SCALAR),
    "top_p": st.one_of(st.sampled_from([0.1, 1]), _NUMBER),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 5]), _NUMBER),
    "seed": st.one_of(st.none(), _NUMBER, _SCALAR),
    "stop": st.one_of(st.none(), _TEXT, st.lists(_TEXT, max_size=3), JSON_VALUE),
    "stream": st.one_of(st.booleans(), _SCALAR),
    "stream_options": st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        ),
        JSON_VALUE,
    ),
    "n": st.one_of(st.just(1), _NUMBER),
    "ignore_eos": st.one_of(st.booleans(), _SCALAR),
    "min_tokens": st.one_of(st.just(0), _NUMBER),
    "kv_transfer_params": st.one_of(st.none(), _KV_PARAMS),
    "cache_salt": st.one_of(st.none(), _TEXT, _SCALAR),
    "return_token_ids": st.one_of(st.booleans(), _SCALAR),
    "logprobs": st.one_of(st.none(), st.booleans(), _NUMBER),
    "echo": st.one_of(st.booleans(), _SCALAR),
}
_PROMPT = st.one_of(
    _TEXT,
    st.lists(st.integers(-5, 300), max_size=20),
    st.lists(_TEXT, max_size=3),
    st.lists(st.lists(st.integers(-5, 300), max_size=10), max_size=2),
    JSON_VALUE,
)
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": _TEXT}),
    st.fixed_dictionaries(
        {
            "role": _SCALAR,
            "content": st.one_of(
                st.none(),
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2
                ),
                JSON_VALUE,
            ),
        }
    ),
    JSON_VALUE,
)


def _perturb(field_names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """One to three fields set to hostile values (the rest of the body stays valid)."""
    return st.lists(st.sampled_from(field_names), min_size=1, max_size=2, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: _FIELDS[n] for n in names})
    )


_VALID_SAMPLING = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 6)},
    optional={
        "temperature": st.sampled_from([0, 0.8]),
        "stream": st.booleans(),
        "seed": st.integers(0, 2**31),
        "return_token_ids": st.booleans(),
    },
)
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **_SAMPLING_FIELDS,
    "prompt": _PROMPT,
    "messages": st.one_of(st.lists(_MESSAGE, max_size=3), JSON_VALUE),
    "max_completion_tokens": st.one_of(st.integers(1, 4), _NUMBER, _SCALAR),
    "add_generation_prompt": _SCALAR,
    "min_completion_tokens": _NUMBER,
}
_VALID_PROMPT = st.one_of(
    _TEXT.filter(bool), st.lists(st.integers(0, 255), min_size=1, max_size=40)
)
_VALID_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": _TEXT}),
    min_size=1,
    max_size=3,
)


def _merge(*parts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part)
    return out


COMPLETION_BODY = st.one_of(
    st.builds(_merge, st.fixed_dictionaries({"prompt": _VALID_PROMPT}), _VALID_SAMPLING),
    st.builds(
        _merge,
        st.fixed_dictionaries({"prompt": _VALID_PROMPT}),
        _VALID_SAMPLING,
        _perturb(
            [
                k
                for k in _FIELDS
                if k not in ("messages",) and not k.startswith(("max_comp", "add_", "min_comp"))
            ]
        ),
    ),
    st.fixed_dictionaries({"prompt": _PROMPT}, optional=_SAMPLING_FIELDS),
)
CHAT_BODY = st.one_of(
    st.builds(_merge, st.fixed_dictionaries({"messages": _VALID_MESSAGES}), _VALID_SAMPLING),
    st.builds(
        _merge,
        st.fixed_dictionaries({"messages": _VALID_MESSAGES}),
        _VALID_SAMPLING,
        _perturb([k for k in _FIELDS if k not in ("prompt", "echo")]),
    ),
    st.builds(
        _merge,
        st.fixed_dictionaries({"messages": st.one_of(st.lists(_MESSAGE, max_size=3), JSON_VALUE)}),
        st.fixed_dictionaries({"max_tokens": st.integers(1, 4)}),
    ),
)
RAW_BODY = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"",
            b"{",
            b"null",
            b"[]",
            b'{"prompt": "x"',
            b'{"prompt": "x", "max_tokens": NaN}',
            b'{"prompt": "x", "temperature": Infinity}',
            b'{"prompt": "\\ud800", "max_tokens": 2}',
            b'{"prompt": "x", "prompt": 7}',
            b"\xff\xfe{}",
            b'{"prompt": "' + b"\xc3\x28" + b'"}',
            b"[" * 5000 + b"]" * 5000,
        ]
    ),
)
HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "content-type": st.sampled_from(
            ["application/json", "text/plain", "application/x-www-form-urlencoded", "", "*/*"]
        ),
        "x-request-id": st.text(
            alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300
        ),
        "authorization": st.sampled_from(["Bearer x", "", "Basic ???"]),
    },
)


def encode_body(body: Any) -> bytes:
    """JSON text as a client may send it: lone surrogates stay ``\\udXXX`` escapes."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode("ascii")
