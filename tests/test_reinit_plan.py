"""core/reinit.py: what a session's recipe keeps, what a re-initialization replays, how its answer is
judged."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mcpresume.core.reinit import (
    INITIALIZED,
    SET_LEVEL,
    SHAPING,
    SUBSCRIBE,
    UNSUBSCRIBE,
    Outcome,
    Recipe,
    Step,
    begin,
    covers,
    fold,
    judge,
    list_changed,
    replay,
    told,
    with_standalone,
)

PARAMS = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "c", "version": "1"}}
CAPS = {"tools": {"listChanged": True}, "resources": {"subscribe": True, "listChanged": False}, "logging": {}}


def recipe(**kw: Any) -> Recipe:
    base = begin(PARAMS)
    assert base is not None
    return Recipe(**{"params": base.params, **kw})


# -- the fold's table, a row each ----------------------------------------------------------------------------


def test_initialize_begins_a_recipe_of_its_params_only_when_they_are_an_object() -> None:
    assert begin(PARAMS) == Recipe(params=PARAMS)
    assert begin([1]) is None and begin(None) is None


def test_set_level_keeps_the_last_level_and_an_unchanged_one_writes_nothing() -> None:
    first = fold(recipe(), SET_LEVEL, {"level": "debug"})
    assert first is not None and first.level == "debug"
    assert fold(first, SET_LEVEL, {"level": "debug"}) is None
    second = fold(first, SET_LEVEL, {"level": "error"})
    assert second is not None and second.level == "error"


def test_subscribe_adds_and_unsubscribe_removes_and_a_no_op_writes_nothing() -> None:
    one = fold(recipe(), SUBSCRIBE, {"uri": "file:///a"})
    assert one is not None and one.subscriptions == {"file:///a"}
    assert fold(one, SUBSCRIBE, {"uri": "file:///a"}) is None
    assert fold(one, UNSUBSCRIBE, {"uri": "file:///b"}) is None
    none = fold(one, UNSUBSCRIBE, {"uri": "file:///a"})
    assert none is not None and none.subscriptions == frozenset()


def test_any_other_request_or_unreadable_params_change_nothing() -> None:
    assert fold(recipe(), "tools/call", {"name": "x"}) is None
    assert fold(recipe(), SET_LEVEL, {"level": 3}) is None
    assert fold(recipe(), SUBSCRIBE, {"uri": None}) is None
    assert fold(recipe(), SUBSCRIBE, ["file:///a"]) is None


def test_the_standalone_flag_is_written_only_when_it_changes() -> None:
    opened = with_standalone(recipe(), True)
    assert opened is not None and opened.standalone
    assert with_standalone(opened, True) is None
    assert with_standalone(recipe(), False) is None


def test_what_the_client_was_told_is_kept_when_readable() -> None:
    kept = told(recipe(), {"protocolVersion": "2025-11-25", "capabilities": CAPS, "serverInfo": {}})
    assert kept is not None and kept.version == "2025-11-25" and kept.capabilities == CAPS
    assert told(recipe(), {"capabilities": CAPS}) is None
    assert told(recipe(), "x") is None


# -- the replay ----------------------------------------------------------------------------------------------


def test_replay_is_initialize_initialized_level_then_subscriptions_sorted() -> None:
    r = recipe(level="info", subscriptions=frozenset({"b://2", "a://1"}))
    assert replay(r) == (
        Step("initialize", PARAMS),
        Step(INITIALIZED, None, notification=True),
        Step(SET_LEVEL, {"level": "info"}),
        Step(SUBSCRIBE, {"uri": "a://1"}),
        Step(SUBSCRIBE, {"uri": "b://2"}),
    )


def test_a_bare_recipe_replays_the_handshake_only() -> None:
    assert [s.method for s in replay(recipe())] == ["initialize", INITIALIZED]


shaping = st.tuples(
    st.sampled_from([*sorted(SHAPING), "tools/call"]),
    st.sampled_from(["debug", "info", "error", "file:///a", "file:///b", "file:///c"]),
)


def apply(r: Recipe, method: str, value: str) -> Recipe:
    key = "level" if method == SET_LEVEL else "uri"
    return fold(r, method, {key: value}) or r


@given(st.lists(shaping, max_size=30))
def test_the_fold_matches_a_reference_model_and_replaying_it_rebuilds_the_same_recipe(
    requests: list[tuple[str, str]],
) -> None:
    """Against a model (the last level; a set of URIs): the recipe is the state the requests left; a replay
    folded into a fresh recipe (what a second loss would replay) is that same recipe again."""
    r, level, uris = recipe(), None, set()
    for method, value in requests:
        r = apply(r, method, value)
        if method == SET_LEVEL:
            level = value
        elif method == SUBSCRIBE:
            uris.add(value)
        elif method == UNSUBSCRIBE:
            uris.discard(value)
    assert r.level == level and r.subscriptions == uris
    again = recipe()
    for step in replay(r)[2:]:
        assert step.params is not None
        again = fold(again, step.method, step.params) or again
    assert again == r
    assert Recipe.decode(r.encode()) == r


# -- the judgement of the new upstream's answer -------------------------------------------------------


def test_judge_rows() -> None:
    r = told(recipe(), {"protocolVersion": "2025-11-25", "capabilities": CAPS})
    assert r is not None
    more = {**CAPS, "prompts": {"listChanged": True}}
    assert judge(r, {"protocolVersion": "2025-11-25", "capabilities": more}) is Outcome.REINITIALIZED
    assert judge(r, {"protocolVersion": "2025-06-18", "capabilities": CAPS}) is Outcome.VERSION_CHANGED
    fewer = {"resources": {"subscribe": True}, "logging": {}}
    assert judge(r, {"protocolVersion": "2025-11-25", "capabilities": fewer}) is Outcome.FEWER_CAPABILITIES
    lost = {**CAPS, "tools": {"listChanged": False}}
    assert judge(r, {"protocolVersion": "2025-11-25", "capabilities": lost}) is Outcome.FEWER_CAPABILITIES
    assert judge(r, {"error": 1}) is Outcome.REFUSED
    # A recipe that never learnt what the client was told: any readable answer.
    assert judge(recipe(), {"protocolVersion": "2024-11-05", "capabilities": {}}) is Outcome.REINITIALIZED


json_flags = st.recursive(
    st.booleans() | st.text(max_size=3),
    lambda inner: st.dictionaries(st.sampled_from(["a", "b", "c", "listChanged"]), inner, max_size=3),
    max_leaves=8,
)


@given(json_flags, json_flags)
def test_covers_is_reflexive_and_a_merge_covers_both(a: Any, b: Any) -> None:
    assert covers(a, a)
    if isinstance(a, dict) and isinstance(b, dict):
        merged = {**b, **a}  # a's values win: covers a
        assert covers(merged, a)


def test_list_changed_only_where_the_client_was_told_list_changed() -> None:
    r = recipe(capabilities={**CAPS, "prompts": {"listChanged": True}})
    assert list_changed(r) == ("notifications/tools/list_changed", "notifications/prompts/list_changed")
    assert list_changed(recipe()) == ()
