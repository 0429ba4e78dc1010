"""Which pipeline stages each pp rank holds, as data (no torch): shared by the pipeline that runs them
(relayrl.parallel.pipeline), the weight-sync layouts (relayrl.sync.layout) and anyone planning a layout.

    schedule            stages per rank   placement (torchtitan's stage_ids_this_rank)
    gpipe, 1f1b         1                 rank r holds stage r
    interleaved_1f1b    2                 loop: rank r holds r, r + p
    interleaved_zb      2                 loop
    zbv, dualpipev      2                 v: rank r holds r and 2p - 1 - r (rank 0: the first and the last)

It imports relayrl.errors only; it must never import another relayrl layer: they import it.
"""

from __future__ import annotations

from relayrl.errors import ConfigError

# name -> (stages per rank, placement); the names are relayrl.parallel.config.PP_SCHEDULES
SCHEDULE_STAGES = {
    "gpipe": (1, "loop"),
    "1f1b": (1, "loop"),
    "interleaved_1f1b": (2, "loop"),
    "interleaved_zb": (2, "loop"),
    "zbv": (2, "v"),
    "dualpipev": (2, "v"),
}
STAGE_STYLES = ("loop", "v")


def check_schedule(name: str) -> None:
    if name not in SCHEDULE_STAGES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULE_STAGES)}")


def stage_ids_this_rank(pp_rank: int, pp: int, stages_per_rank: int, style: str = "loop") -> tuple[int, ...]:
    """The global stage indices pp rank `pp_rank` holds, in the order its schedule runs them."""
    if style not in STAGE_STYLES:
        raise ConfigError(f"stage style must be one of {STAGE_STYLES}, got {style!r}")
    if style == "v":
        if stages_per_rank != 2:
            raise ConfigError(f"V-style schedules hold 2 stages per rank, got {stages_per_rank}")
        return pp_rank, 2 * pp - 1 - pp_rank
    return tuple(pp_rank + s * pp for s in range(stages_per_rank))


def schedule_stages(schedule: str, pp_rank: int, pp: int) -> tuple[tuple[int, ...], int]:
    """(the stage indices pp rank `pp_rank` holds, the number of stages) under `schedule`."""
    check_schedule(schedule)
    per_rank, style = SCHEDULE_STAGES[schedule]
    return stage_ids_this_rank(pp_rank, pp, per_rank, style), pp * per_rank
