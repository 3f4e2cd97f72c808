"""Local: every replica trains alone and never synchronizes across clusters. The compute ceiling.

Same model, data, batch and inner AdamW as every other method, minus all cross-cluster communication, so its
tokens/s is the most the cluster can train on these settings; a method's tokens/s divided by local's is its
compute utilisation. Replicas drift apart (each sees only its own data shard): evaluation runs on each replica's
own model, so its loss is one replica's and is not comparable to a synchronized method's at equal tokens.
Pipeline stages inside a cluster still talk to each other (gradient clipping spans the whole replica).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainers.method import Method, MethodConfig, SyncReport


@dataclass(frozen=True)
class LocalConfig(MethodConfig):
    """Local has no knobs: it is AllReduce without the all-reduce."""

    def fault_tolerance_refusal(self) -> str | None:
        return (
            "local never communicates, so its replicas have no rounds to agree on and nothing to heal from; run it "
            "without fault tolerance"
        )


class Local(Method):
    config_class = LocalConfig
    resumable = True  # the inner AdamW is all it keeps: the base class's state_dict

    def step(self, step: int) -> SyncReport | None:
        self.inner.step()
        return None
