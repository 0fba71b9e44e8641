"""What the model side hands the web layer once loaded; until then chat routes answer 503."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inference.host.threads import ThreadGovernor
from inference.runtime.grammar import SchemaCompiler
from inference.runtime.jobs import SamplingDefaults
from inference.runtime.prompt import PromptBuilder
from inference.runtime.worker import Worker
from web.access.keys import KeyRing

if TYPE_CHECKING:  # torch, which it imports, loads only after the CPU split (server.py)
    from inference.model.prefix_cache import PrefixCache


@dataclass
class Runtime:
    worker: Worker | None = None
    prompts: PromptBuilder | None = None
    model_name: str | None = None
    status: str = "starting"
    grammars: SchemaCompiler | None = None  # JSON schemas -> token masks
    keys: KeyRing = field(default_factory=KeyRing)
    created: int = field(default_factory=lambda: int(time.time()))  # for /v1/models
    cpu: dict | None = None  # inference.host.cpu.Plan.as_dict(): the CPU's paths, for /health
    thread_governor: ThreadGovernor | None = None  # --thread-policy adaptive
    decode_step: str | None = None  # "native avx2" ... or "torch": Engine.decode_step
    logits_width: int | None = None  # Engine.vocab_size: may be under the tokenizer's ids
    weights_digest: str | None = None  # Engine.weights_digest: equal on PCs that agree
    prefixes: PrefixCache | None = None  # Engine.prefixes: the shared prefix cache, when on
    # What a request silent on temperature, top_p, top_k, min_p, repetition_penalty gets
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    @property
    def ready(self) -> bool:
        return self.worker is not None
