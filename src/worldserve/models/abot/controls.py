"""ABot-World's controls: its eight keys, and the keys one AR block applies.

Owns: :data:`KEY_ORDER` (the order of the model's action bits), :data:`CONFLICT_PAIRS`,
:data:`KEYS_SCHEMA` (the ``keys`` track, ``worldserve.keys.v1``: the keys held now, from the eight),
:class:`BlockKeys` (the keys a block applies, as the model's bits) and :func:`block_keys` (a tick's
held keys, and the block before's, -> the block's keys). Must not know: torch, sessions.

What the reference does (``amap-cvlab/ABot-World``), and what this keeps of it:

- **Keys and bits.** ``pipeline/causal_inference.py`` ``set_act`` turns the keys of a block into
  eight bits in the order W A S D I J K L (``web_client/config.py`` ``KEY_ORDER``): W/S move forward
  and back, A/D left and right; I/K turn the view up and down, J/L left and right (the web client
  maps the arrow keys to I J K L, ``web_client/key_handler.js``). Once per block (three latent
  frames, twelve video frames) its streaming demo samples the keys (``web_client/inference.py``,
  ``keyboard._sample_key_snapshot``); here a tick is that sample.
- **Conflicts.** W/S, A/D, I/K and J/L exclude each other (``CONFLICT_GROUPS``). The web client
  keeps the key of a pair pressed last (``resolveConflicts``: the latest ``pressTime``), and the
  server's snapshot lets a key pressed since the last block win over one held from before
  (``_resolve_conflicts`` with ``activated`` first). A held-keys event carries no press times, so
  :func:`block_keys` takes "pressed last" from the block before: of a pair held together, the key
  not held in the block before wins (it was pressed since); when both or neither were, the one the
  block before applied stays; pressed in the same tick from nothing, the first in ``KEY_ORDER``.
- **Taps.** The reference's ``activated`` set also carries a key pressed and released between two
  samples, so a tap shorter than a block still moves the world for one block. The control plane does
  the same for every held-keys track (``worldserve.session``): a tick's ``keys`` hold the keys held
  at its boundary and those pressed since the last one, so a tap reaches :func:`block_keys` here.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from worldserve.models.base import ControlSchema
from worldserve.protocol import ControlInput

__all__ = [
    "CONFLICT_PAIRS",
    "KEYS_SCHEMA",
    "KEYS_TRACK",
    "KEY_ORDER",
    "NO_KEYS",
    "BlockKeys",
    "block_keys",
    "held_keys",
]

KEYS_TRACK = "keys"
#: The model's action bits, in order (``web_client/config.py`` ``KEY_ORDER``; ``set_act``'s ``key_order``).
KEY_ORDER: tuple[str, ...] = ("W", "A", "S", "D", "I", "J", "K", "L")
#: Keys that exclude each other (``web_client/config.py`` ``CONFLICT_GROUPS``).
CONFLICT_PAIRS: tuple[tuple[str, str], ...] = (("W", "S"), ("A", "D"), ("I", "K"), ("J", "L"))

KEYS_SCHEMA = ControlSchema(
    track=KEYS_TRACK,
    schema="worldserve.keys.v1",
    description=(
        "Keys held now (held-key state: it lasts until the next keys event): W forward, S back, A left, "
        "D right; I look up, K look down, J turn left, L turn right. Of W/S, A/D, I/K or J/L held together "
        "the one pressed last counts. Sampled once per chunk, for all its frames."
    ),
    json_schema={
        "type": "object",
        "properties": {
            "held": {"type": "array", "items": {"enum": list(KEY_ORDER)}, "uniqueItems": True},
        },
        "required": ["held"],
        "additionalProperties": False,
    },
    example={"held": ["W"]},
)


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """The keys one block applies (conflicts resolved) and what was held, for the next block's choice."""

    applied: frozenset[str]
    held: frozenset[str]

    @property
    def bits(self) -> tuple[int, ...]:
        """The model's eight action bits (``KEY_ORDER``)."""
        return tuple(1 if key in self.applied else 0 for key in KEY_ORDER)


#: Before the first block: nothing held, nothing applied.
NO_KEYS = BlockKeys(frozenset(), frozenset())


def held_keys(controls: Sequence[ControlInput]) -> frozenset[str]:
    """The keys a tick's controls hold (none without a ``keys`` control)."""
    for control in controls:
        if control.track == KEYS_TRACK:
            return frozenset(str(key) for key in control.data["held"])
    return frozenset()


def block_keys(held: Collection[str], before: BlockKeys = NO_KEYS) -> BlockKeys:
    """The keys a block applies when ``held`` are held, ``before`` being the block before's."""
    unknown = sorted(set(held) - set(KEY_ORDER))
    if unknown:
        raise ValueError(f"abot-world takes the keys {', '.join(KEY_ORDER)}; got {', '.join(unknown)}.")
    held_now = frozenset(held)
    applied = set(held_now)
    for first, second in CONFLICT_PAIRS:
        if first not in applied or second not in applied:
            continue
        first_new, second_new = first not in before.held, second not in before.held
        if first_new != second_new:
            loser = second if first_new else first  # the one held from before loses to the one pressed since
        elif (first in before.applied) != (second in before.applied):
            loser = second if first in before.applied else first  # the winner of the block before stays
        else:
            loser = second  # no order known: the first in KEY_ORDER
        applied.discard(loser)
    return BlockKeys(frozenset(applied), held_now)
