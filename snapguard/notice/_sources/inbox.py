"""The local inbox `snapguard notice` writes to: one JSON file per notice, named by its id.

Reading it never blocks and never follows a link: each entry is opened `O_NOFOLLOW | O_NONBLOCK`
and must be a regular file with one link, root's when the agent is root, at most `MAX_ENTRY`
bytes, JSON of the inbox entry's schema. An entry refused on any of these is moved aside into
`<inbox>/refused/` (so it is read once), recorded (`Refusals`: the agent journals it with its typed
reason) and passed over: the next entry is still read.

Between polls the agent waits on the inbox with inotify (`wait`, snapguard.notice._sources._dirwatch):
an entry renamed into it ends the wait, so a posted notice is read at once, not a poll interval
later.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time

from ...reasons import Reason, SnapguardError
from ._base import Notice, Refusals, with_deadline
from ._dirwatch import DirWatch
from ._http import malformed, unavailable
from ._parse import parse
from ._schemas import INBOX_ENTRY

__all__ = ["MAX_ENTRY", "Local"]

MAX_ENTRY = 64 * 1024
REFUSED = "refused"


class Local(Refusals):
    """The inbox as a notice source."""

    name = "local"
    lead_s = None

    def __init__(self, inbox: str) -> None:
        super().__init__()
        self.inbox = inbox
        self.watch = DirWatch(inbox)

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """Until an entry lands in the inbox (True), `timeout` passes or `stop` is set (False)."""
        return self.watch.wait(timeout, stop)

    def _read(self, path: str) -> bytes | None:
        """The entry's bytes; None when it went away; SnapguardError when it is refused."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise SnapguardError(Reason.UNTRUSTED_PATH, f"inbox entry {path} is a symbolic link: not followed",
                                     evidence={"path": path}) from None
            raise unavailable(self.name, path, e.strerror or str(e)) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise malformed(self.name, path, "not a regular file (a FIFO, socket or device is never read)")
            if st.st_nlink != 1:
                raise SnapguardError(Reason.UNTRUSTED_PATH, f"inbox entry {path} has {st.st_nlink} links",
                                     evidence={"path": path})
            if os.geteuid() == 0 and st.st_uid != 0:
                raise SnapguardError(Reason.UNTRUSTED_PATH, f"inbox entry {path} is owned by uid {st.st_uid}, "
                                     "not root: only root's notices count", evidence={"path": path})
            if st.st_size > MAX_ENTRY:
                raise malformed(self.name, path, f"{st.st_size} bytes (at most {MAX_ENTRY})")
            return os.read(fd, MAX_ENTRY + 1)
        finally:
            os.close(fd)

    def _set_aside(self, name: str) -> None:
        aside = os.path.join(self.inbox, REFUSED)
        try:
            os.mkdir(aside, 0o700)
        except FileExistsError:
            pass
        try:
            os.rename(os.path.join(self.inbox, name), os.path.join(aside, f"{name}.{time.time_ns()}"))
        except OSError:
            try:
                os.unlink(os.path.join(self.inbox, name))
            except OSError:
                pass

    def poll(self, deadline: float) -> Notice | None:
        self.watch.arm()  # before the listing: an entry that lands after it ends the next wait
        try:
            names = sorted(n for n in os.listdir(self.inbox) if n.endswith(".json"))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise unavailable(self.name, self.inbox, e.strerror or str(e)) from None
        for n in names:
            if time.monotonic() > deadline:
                break  # the rest on the next poll
            path = os.path.join(self.inbox, n)
            try:
                body = self._read(path)
                if body is None:
                    continue
                doc = parse(self.name, path, body, max_bytes=MAX_ENTRY, schema=INBOX_ENTRY)
            except SnapguardError as err:
                if err.reason is Reason.NOTICE_SOURCE_UNAVAILABLE:
                    raise
                self.refuse(err, path)
                self._set_aside(n)
                continue
            deadline_at = doc.get("deadline")
            return with_deadline(f"local:{doc['id']}", self.name, "operator", doc.get("reason") or "operator notice",
                                 float(deadline_at) if deadline_at is not None else None, {**doc, "path": path})
        return None
