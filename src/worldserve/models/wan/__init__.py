"""The Wan parts every Wan-based family shares: ``wan-causal``, ``matrix-game-2`` and those to come.

Owns: the block-causal Wan geometry and its arithmetic (:mod:`.config`), the transformer's blocks
and head over a batch of sessions' caches (:mod:`.blocks`), the KV caches (:mod:`.cache`), RoPE at
each row's frame offset (:mod:`.rope`), the few-step sampler and commit pass (:mod:`.sampler`),
per-session counter-based noise (:mod:`.noise`), the causal VAE streamed per session
(:mod:`.vae`, its published weights: :mod:`.vaeweights`), TAEHV (:mod:`.taehv`) and the choice
between the two (:mod:`.decoders`), the UMT5 text encoder (:mod:`.t5`, :mod:`.text`), reading
published weight files and the errors that name what does not fit (:mod:`.statedict`), a
transformer checkpoint's state and renaming (:mod:`.checkpoint`), the folder walk of published
files (:mod:`.files`), the diffusers modules (:mod:`.build`), the model options every Wan model
takes (:mod:`.options`) and what every Wan model's construction and step share (:mod:`.serving`).
Must not know: any one family's settings, published names, conditioning or controls (those live
in ``wancausal/`` and ``matrixgame/``), sessions, the runtime.
"""
