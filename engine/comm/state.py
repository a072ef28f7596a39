"""The process's communication state, one record shared by the modules of engine/comm/.

One record rather than one per module: destroy_process_group() (lifecycle.py) ends the default group
and with it what every other module kept about it (subgroups, sequence numbers, the link measurement),
and resets them all in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from engine.comm.groups import Subgroup
    from engine.comm.link import LinkSpeed


@dataclass
class CommState:
    # ---------------------------------------------------------------- process lifecycle (lifecycle.py)
    owns_group: bool = False
    """True when init_distributed created the default group, so destroy() may tear it down."""
    world_size_source: str = "not initialised"
    """Where the world size came from, quoted in batch-size error messages."""
    implicit_group: bool = False
    """True when engine.initialize() created the group (the user never called init_distributed)."""
    engine_refs: int = 0
    """Live engines using an implicit group; the last one to be destroyed tears it down."""
    store: Any = None
    """The launch environment's rendezvous store, kept for the process's life (see _init_from_env)."""
    store_key: tuple[str, ...] = ()
    """The environment `store` was made for (a different MASTER_PORT makes a new one)."""
    groups_made: int = 0
    """Groups created on `store` so far: the next group's key prefix (the same count on every rank)."""
    generation: int = 0
    """Default groups destroyed so far: subgroups made under an older generation are dead."""
    # ------------------------------------------------------------------------ subgroups (groups.py)
    subgroups: dict[ProcessGroup, Subgroup] = field(default_factory=dict)
    """Subgroups made by new_group: their name and members."""
    # -------------------------------------------------------------------- collectives (collectives.py)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    collectives: str = "engine"
    """The config's "collectives": "engine", "ring" or "native" (set_collectives)."""
    p2p_seq: int = 0
    """Point-to-point collectives issued so far (engine/comm/p2p.py): the same count on every rank."""
    group_seq: dict[ProcessGroup, int] = field(default_factory=dict)
    """Point-to-point collectives issued on each subgroup (as p2p_seq for the world)."""
    # ------------------------------------------------------------------------------ link (link.py)
    link: LinkSpeed | None = None
    """measure_link()'s result, measured once per process group."""


STATE = CommState()
