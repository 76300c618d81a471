"""The verdict oracle's group testing (tests/oraclekit.py), with a judge that knows the truth: a
replay of several perturbations hits when none of them reaches a key."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tests.oraclekit import Truth, first_fit, truths

TOUCHES = {"a": {"X"}, "b": {"Y"}, "c": {"X"}, "d": set(), "e": {"Y", "Z"}, "f": {"W"}}


def test_members_touching_the_same_thing_go_into_separate_groups() -> None:
    assert first_fit(list(TOUCHES), TOUCHES.__getitem__) == [["a", "b", "d", "f"], ["c", "e"]]
    assert first_fit([], TOUCHES.__getitem__) == []


class Judge:
    """Replays: a set of members hits unless one of them is in `reaching` (or the combination is
    one of `interacting`: the assumption broken); every replay is recorded."""

    def __init__(self, reaching: set[str], interacting: tuple[frozenset[str], ...] = ()) -> None:
        self.reaching, self.interacting, self.replays = reaching, interacting, []

    def __call__(self, members: Sequence[str]) -> Truth:
        self.replays.append(tuple(members))
        hit = not self.reaching & set(members) and frozenset(members) not in self.interacting
        return Truth(hit, f"replay of {'+'.join(members)}")


def test_a_combined_hit_judges_every_member_in_one_replay() -> None:
    judge = Judge(reaching=set())
    judged, combinations = truths([["a", "b", "d"], ["c"]], judge, str)
    assert judge.replays == [("a", "b", "d"), ("c",)]
    assert [(m, t.hit, t.shared) for m, t in judged] == [("a", True, 3), ("b", True, 3), ("d", True, 3), ("c", True, 1)]
    assert combinations == []


def test_a_combined_miss_replays_each_member_alone_and_names_who_misses() -> None:
    judge = Judge(reaching={"b"})
    with ThreadPoolExecutor(2) as pool:
        judged, combinations = truths([["a", "b", "d"], ["c"], ["f"]], judge, str, pool.map)
    assert sorted(judge.replays) == sorted([("a", "b", "d"), ("a",), ("b",), ("d",), ("c",), ("f",)])
    assert [(m, t.hit, t.shared) for m, t in judged] == [
        ("a", True, 1), ("b", False, 1), ("d", True, 1), ("c", True, 1), ("f", True, 1)
    ]  # fmt: skip
    assert judged[1][1].detail == "replay of b"
    assert combinations == []


def test_a_combination_that_misses_while_each_member_alone_hits_is_a_disagreement() -> None:
    judge = Judge(reaching=set(), interacting=(frozenset("ab"),))
    judged, combinations = truths([["a", "b"]], judge, str)
    assert [(m, t.hit) for m, t in judged] == [("a", True), ("b", True)]
    assert combinations == ["together (a, b): replay missed (replay of a+b), though each alone hit"]


def test_a_group_of_one_is_replayed_once() -> None:
    judge = Judge(reaching={"a"})
    judged, _ = truths([["a"]], judge, str)
    assert judge.replays == [("a",)] and not judged[0][1].hit
