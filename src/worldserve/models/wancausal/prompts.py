"""Prompt changes of one session: which embedding each block uses, and when the cached context is stale.

Owns: :data:`PROMPT_TRANSITION_SCHEMA` (the ``prompt_transition`` control track this model
declares: ``{"chunks": N}``, the number of blocks a prompt change blends over, sent with the
event that changes the prompt; not coalesced), :class:`PromptTrack` (per session: the prompt
the session is heading to, the embedding its blocks use, a transition in progress, and the
embedding its cached context was computed under) and :class:`PromptPlan` (one block's
decision, applied with :meth:`PromptTrack.apply` only after the step succeeded, so a failed
step changes nothing). The rule: when a tick's prompt differs from the one the session is
heading to, a transition starts from the embedding in use to the new prompt's, over ``N``
blocks (the tick's ``prompt_transition`` control, else the model's default): block ``k`` of
``N`` uses ``lerp(old, new, k / (N + 1))`` and the block after them the new embedding alone
(``N = 0``: at once). With ``prompt_switch=recache`` a block whose embedding differs from the
one its cached context was computed under recomputes that context first. Must not know: the
transformer, caches' layout, sessions' control plane.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from worldserve.models.base import ControlSchema
from worldserve.protocol import PROMPT_TRANSITION_SCHEMA_NAME, PROMPT_TRANSITION_TRACK, ControlInput

__all__ = ["MAX_TRANSITION", "PROMPT_TRANSITION_SCHEMA", "PromptPlan", "PromptTrack", "transition_schema"]

#: The longest transition a control may ask for, in blocks.
MAX_TRANSITION = 64


def transition_schema(default: int) -> ControlSchema:
    """The ``prompt_transition`` track, with the model's default transition in its description."""
    return ControlSchema(
        track=PROMPT_TRANSITION_TRACK,
        schema=PROMPT_TRANSITION_SCHEMA_NAME,
        description=(
            "How many chunks a prompt change blends over (the prompt embedding moves from the old prompt to "
            "the new one over N chunks; 0: at once). Send it with the event that changes the prompt; like any "
            f"control it holds until replaced. Without it: {default}."
        ),
        json_schema={
            "type": "object",
            "properties": {"chunks": {"type": "integer", "minimum": 0, "maximum": MAX_TRANSITION}},
            "required": ["chunks"],
            "additionalProperties": False,
        },
        example={"chunks": 3},
    )


PROMPT_TRANSITION_SCHEMA = transition_schema(0)


def requested_transition(controls: Sequence[ControlInput]) -> int | None:
    for control in controls:
        if control.track == PROMPT_TRANSITION_TRACK:
            return int(control.data["chunks"])
    return None


#: What an embedding is: (the prompt blended from, the prompt blended to, weight of the latter).
EmbeddingKey = tuple[str, str, float]


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """One block's prompt: its embedding, what that embedding is, and the track's state after the block."""

    embedding: Tensor
    key: EmbeddingKey
    recache: bool
    target: str
    source: str
    source_embedding: Tensor
    blocks: int  # blocks of the transition, N
    done: int  # blocks of the transition done after this one


class PromptTrack:
    """One session's prompt state; changed only through :meth:`apply`."""

    __slots__ = ("blocks", "context_key", "done", "embedding", "key", "source", "source_embedding", "target")

    def __init__(self, prompt: str, embedding: Tensor) -> None:
        self.target = prompt
        self.source = prompt
        self.source_embedding = embedding
        self.embedding = embedding
        self.key: EmbeddingKey = (prompt, prompt, 1.0)
        #: The embedding the cached context was computed under.
        self.context_key: EmbeddingKey = self.key
        self.blocks = 0
        self.done = 0

    def plan(
        self, prompt: str, controls: Sequence[ControlInput], embed: Callable[[str], Tensor], default: int, recache: bool
    ) -> PromptPlan:
        target, source, source_embedding, blocks, done = (
            self.target,
            self.source,
            self.source_embedding,
            self.blocks,
            self.done,
        )
        if prompt != self.target:  # a change: blend from the embedding in use now
            requested = requested_transition(controls)
            target = prompt
            source, source_embedding = f"{self.key[0]}|{self.key[1]}@{self.key[2]:.6g}", self.embedding
            blocks = requested if requested is not None else default
            done = 0
        if done < blocks + 1 and target != source:
            done += 1
            weight = done / (blocks + 1)
            new = embed(target)
            embedding = source_embedding.lerp(new, weight) if weight < 1.0 else new
            key: EmbeddingKey = (source, target, weight) if weight < 1.0 else (target, target, 1.0)
        else:
            embedding, key = embed(target), (target, target, 1.0)
        return PromptPlan(
            embedding=embedding,
            key=key,
            recache=recache and key != self.context_key,
            target=target,
            source=source,
            source_embedding=source_embedding,
            blocks=blocks,
            done=done,
        )

    def apply(self, plan: PromptPlan) -> None:
        """The block of ``plan`` was generated and committed: its context now carries ``plan``'s embedding."""
        self.target = plan.target
        self.source = plan.source
        self.source_embedding = plan.source_embedding
        self.embedding = plan.embedding
        self.key = plan.key
        self.blocks = plan.blocks
        self.done = plan.done
        self.context_key = plan.key

    def clone(self) -> PromptTrack:
        twin = PromptTrack.__new__(PromptTrack)
        for name in PromptTrack.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin
