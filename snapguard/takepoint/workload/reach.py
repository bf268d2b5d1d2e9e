"""Where a trainer's rendezvous is, and whether the take point can own it: the checks behind
`groups`' wrapped init_process_group (what it cannot release, one line), the store's address
from init_method or torchrun's environment, and this host's address on the route to it."""

from __future__ import annotations

import os
import socket
from typing import Any

from .. import protocol
from . import agent_link

__all__ = ["address", "agent_store", "agent_unreached", "local_address", "unreached"]


def local_address(host: str, port: int) -> str:
    """The address of this host on the route to the rendezvous (a UDP socket's connect sends
    nothing): what gloo's device binds, so a rank restored elsewhere binds its new address."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return str(s.getsockname()[0])
    except OSError:
        return ""


def unreached(init_method: str | None, store: Any, rank: int = -1, world_size: int = -1) -> str | None:
    """Why the take point cannot own this init's rendezvous (one line), or None."""
    if store is not None:
        return "init_process_group was given a store of the trainer's: not released at the hold"
    if agent_store():
        why = agent_unreached()
        if why:
            return why
    if init_method not in (None, "env://") and not (str(init_method).startswith("tcp://") and "?" not in init_method):
        return f"init_method {str(init_method)[:80]}: only env:// and tcp://HOST:PORT are released at the hold"
    if init_method in (None, "env://") and not (os.environ.get("MASTER_ADDR") and
                                                 os.environ.get("MASTER_PORT", "").isdigit()):
        return "env:// without MASTER_ADDR and MASTER_PORT: torch.distributed's own rendezvous is used"
    for name, given in (("RANK", rank >= 0), ("WORLD_SIZE", world_size > 0)):
        if not given and not os.environ.get(name, "").isdigit():
            return f"no {name} given or in the environment: torch.distributed's own rendezvous is used"
    return None


def agent_store() -> bool:
    """The rendezvous store is torchrun's agent's (torch.distributed reads the variable so)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def agent_unreached() -> str | None:
    """Why the take point cannot release torchrun's agent's store, or None: the agent (the
    parent) runs the take point's agent side, and can release its own connections."""
    path = agent_link.parent_agent()
    if path is None:
        return ("torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True): the agent runs no take point "
                "(start torchrun itself with the take point's environment)")
    try:
        answer = agent_link.ask(path, agent_link.STATUS, 10.0)
    except (OSError, ValueError) as e:
        return f"torchrun's agent store: the agent does not answer ({type(e).__name__}: {e})"[:300]
    left = answer.get(protocol.GROUPS_UNREACHED) or []
    if answer.get(protocol.OK) is not True or left:
        return f"torchrun's agent store: {'; '.join(map(str, left)) or answer.get(protocol.ERROR)}"[:300]
    return None


def address(init_method: str | None) -> tuple[str, int]:
    if init_method and init_method.startswith("tcp://"):
        return protocol.parse_rendezvous(init_method[len("tcp://"):].split("?", 1)[0])
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
