"""The peer server's URL and header parsers, property-tested with hypothesis on every CI run.

The same functions are fuzzed (coverage-guided, alone and behind a real
server) by experiments/fuzz.py; these properties run in a second without any
fuzzing toolchain.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the 'test' extra")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fthsdp.checkpoint.peer_server import Refusal, Route, check_authorization, parse_route  # noqa: E402

_component = st.one_of(st.integers(-5, 10**30).map(str), st.text(max_size=12))


@settings(max_examples=400, deadline=None)
@given(st.one_of(
    st.text(max_size=80),
    st.builds(lambda s: f"/v1/snapshot/{s}/manifest", _component),
    st.builds(lambda a, b, c, q: f"/v1/snapshot/{a}/leaf/{b}/piece/{c}{q}", _component, _component, _component,
              st.sampled_from(["", "?x=1", "?"])),
))
def test_parse_route_never_raises_and_routes_only_nonnegative_ints(path):
    r = parse_route(path)
    if isinstance(r, Refusal):
        assert r.status in (400, 404) and r.error
    else:
        assert isinstance(r, Route)
        assert all(v is None or (type(v) is int and v >= 0) for v in (r.step, r.leaf, r.piece))
        assert r.kind == "manifest" or None not in (r.step, r.leaf, r.piece)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.text(max_size=40), st.builds(lambda t: f"Bearer {t}", st.text(max_size=30))),
       st.text(alphabet="abcXYZ019-_.~", min_size=1, max_size=20).map(str.encode))
def test_authorization_accepts_exactly_the_bearer_token(header, token):
    r = check_authorization(header, token)
    expected_ok = (header is not None and header.startswith("Bearer ") and len(header) > 7
                   and header[7:].strip().encode("utf-8", "surrogateescape") == token)
    assert (r is None) == expected_ok
    assert r is None or (r.status in (401, 403) and r.error)
    assert check_authorization("Bearer " + token.decode(), token) is None
