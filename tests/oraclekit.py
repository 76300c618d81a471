"""Adaptive group testing for the verdict oracle (tests/host/test_verdict_oracle.py): fewer real
replays, the same truth for every perturbation.

The perturbations whose verdict predicts a hit are replayed together, one replay carrying all of
a group's changes at once; those that touch the same thing (a variable, a span of the manifest)
go into separate groups. If that replay hits (compiles nothing), each member hits alone too: a
change that made a key differ alone makes it differ in the combination as well (the others touch
other inputs, and a key is a digest of all of its inputs), so the combined replay would have
compiled. The one assumption: no perturbation undoes another's key change (one change putting
back, through some other input, what another changed). If the
combined replay misses, each member is replayed alone, so that a failure names exactly who
disagrees; and a combination that misses while every member alone hits is itself a disagreement
(its verdict, checked by the caller, said hit). A group of one, and every predicted miss, has its
own replay: each miss must be shown to miss.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Truth:
    hit: bool  # the replay compiled nothing
    detail: str  # the replay's own words
    shared: int = 1  # how many perturbations the replay that judged this one carried
    seconds: float = 0.0


def first_fit(members: Sequence[T], touches: Callable[[T], Iterable[Hashable]]) -> list[list[T]]:
    """Groups, in order: each member joins the first group that touches none of what it touches
    (a member that touches nothing joins the first group)."""
    groups: list[tuple[list[T], set[Hashable]]] = []
    for member in members:
        touched = set(touches(member))
        fit = next((g for g in groups if not g[1] & touched), None)
        if fit is None:
            groups.append(([member], touched))
        else:
            fit[0].append(member)
            fit[1].update(touched)
    return [group for group, _ in groups]


def truths(
    groups: Sequence[Sequence[T]],
    replay: Callable[[Sequence[T]], Truth],
    name: Callable[[T], str],
    run: Callable[..., Iterable[tuple[list[tuple[T, Truth]], list[str]]]] = map,
) -> tuple[list[tuple[T, Truth]], list[str]]:
    """Each member's truth (in the groups' order) and the combinations that missed although every
    member alone hit. `replay(members)` replays their changes together (one member: alone); `run`
    maps a function over the groups (a pool's map: replays in parallel)."""

    def judge(group: Sequence[T]) -> tuple[list[tuple[T, Truth]], list[str]]:
        combined = replay(group)
        if len(group) == 1:
            return [(group[0], combined)], []
        if combined.hit:
            return [(m, replace(combined, shared=len(group))) for m in group], []
        alone = [(m, replay([m])) for m in group]
        if all(t.hit for _, t in alone):
            names = ", ".join(name(m) for m in group)
            return alone, [f"together ({names}): replay missed ({combined.detail}), though each alone hit"]
        return alone, []

    judged: list[tuple[T, Truth]] = []
    combinations: list[str] = []
    for members, complaints in run(judge, groups):
        judged += members
        combinations += complaints
    return judged, combinations
