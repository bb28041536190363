"""The fast channel: copies of a data channel's short messages on a second channel, merged back in order.

A WebRTC session's messages travel on a reliable, ordered data channel. A lost packet holds it until the packet is
resent (a retransmission timeout: 220 ms at least), and every message behind it with it. So each side also sends a
copy of each short message (:data:`FAST_COPY_CHARS` at most) on a second channel, labelled :data:`FAST_LABEL`,
unordered and never resent: first the copy, prefixed with the message's index among the main channel's messages
(:func:`fast_copy`: ``"17:{...}"`` is the 18th message sent on the main channel, the pieces of a long message counted
one by one), then the message itself on the main channel.

A receiver feeds both channels to a :class:`ChannelMerge`, which gives back the one ordered stream the main channel
carries: a copy is read once every message before its index was read (from either channel), and a main message
already read from its copy is passed over. Nothing is read twice or out of order, whichever copy comes first; a lost
copy is only the main channel's delay again. Copies that come ahead of a gap wait for it, :data:`FAST_HELD` at most.

Owns: :class:`ChannelMerge`, the copy's form and when one goes (:func:`send_copy`), the channel's label and limits
(docs/protocol.md, "The fast channel"). Must not know: what the messages mean, the data channel library (callers feed
the merge; :func:`send_copy` only needs a channel's ``readyState`` and ``send``).
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["FAST_COPY_CHARS", "FAST_HELD", "FAST_LABEL", "FAST_MAX_CHARS", "ChannelMerge", "fast_copy", "send_copy"]

#: The second channel's label (opened by the client: unordered, never resent).
FAST_LABEL = "worldserve.fast"
#: A message this long at most (characters) is also sent as a copy (inputs, acks, chunk headers; not a start's images).
FAST_COPY_CHARS = 1024
#: Copies that came ahead of a gap wait, this many at most (the farthest beyond goes: its main copy comes).
FAST_HELD = 32
#: A copy longer than this (characters) is not read: no side sends long messages twice.
FAST_MAX_CHARS = 16 * 1024


def fast_copy(index: int, message: str) -> str:
    """The fast channel's copy of the main channel's message number ``index`` (from 0)."""
    return f"{index}:{message}"


def send_copy(fast: Any, index: int, message: str) -> bool:
    """Send on ``fast`` the copy of the main channel's message number ``index``, when it is short and the channel is
    open; whether it went (a copy that cannot go is no error: the main channel's message is the one that counts)."""
    if fast is None or len(message) > FAST_COPY_CHARS or fast.readyState != "open":
        return False
    with contextlib.suppress(Exception):
        fast.send(fast_copy(index, message))
        return True
    return False


class ChannelMerge:
    """One receiver's merge of a main channel and its fast channel into the main channel's stream, in order."""

    def __init__(self) -> None:
        self._main_count = 0  # messages come on the main channel so far
        self._next_index = 0  # every message of the merged stream before this index was read
        self._ahead: dict[int, str] = {}  # copies that came ahead of a gap, by index
        #: Messages read from their copy (the main channel's was passed over).
        self.taken = 0
        #: Copies not used: late (the main channel's came first), twice, malformed, or too many ahead of a gap.
        self.unused = 0

    @property
    def held(self) -> int:
        """Copies waiting for a gap before them to close."""
        return len(self._ahead)

    def main(self, message: str | bytes) -> list[str | bytes]:
        """The main channel's next message came: what is read now, in order: none (it was read from its copy), or
        this message first, then the copies that waited for it."""
        index = self._main_count
        self._main_count += 1
        if index < self._next_index:
            return []
        self._next_index = index + 1
        if self._ahead.pop(index, None) is not None:
            self.unused += 1
        return [message, *self._take_ahead()]

    def copy(self, raw: str | bytes) -> list[str]:
        """A copy came on the fast channel: what is read now, in order (none: it waits for a gap, or is not used)."""
        index_text, colon, text = raw.partition(":") if isinstance(raw, str) else ("", "", "")
        if not colon or not index_text.isdigit() or len(text) > FAST_MAX_CHARS:
            self.unused += 1
            return []
        index = int(index_text)
        if index < self._next_index or index in self._ahead:
            self.unused += 1  # its main copy came first (or this copy twice)
            return []
        self._ahead[index] = text
        while len(self._ahead) > FAST_HELD:  # the farthest goes; its main copy will come
            del self._ahead[max(self._ahead)]
            self.unused += 1
        return self._take_ahead()

    def _take_ahead(self) -> list[str]:
        read: list[str] = []
        while (text := self._ahead.pop(self._next_index, None)) is not None:
            self._next_index += 1
            self.taken += 1
            read.append(text)
        return read
