"""The upstream URLs of the paths asked, kept parsed (``Upstream._target``)."""

from __future__ import annotations

from mcpresume.streams.upstream import MAX_TARGETS, Upstream


def test_a_path_is_joined_to_the_upstream_origin_as_the_client_sent_it_and_kept_bounded() -> None:
    upstream = Upstream("http://127.0.0.1:9/mcp", connect_timeout=1.0, first_byte_timeout=1.0)
    url = upstream._target("/mcp?key=a%2Fb")
    assert str(url) == "http://127.0.0.1:9/mcp?key=a%2Fb"  # encoded as it came, not re-encoded
    assert upstream._target("/mcp?key=a%2Fb") is url  # parsed once
    assert str(upstream._target("/other/path")) == "http://127.0.0.1:9/other/path"
    for n in range(3 * MAX_TARGETS):
        assert str(upstream._target(f"/p{n}")) == f"http://127.0.0.1:9/p{n}"
    assert len(upstream._targets) <= MAX_TARGETS
