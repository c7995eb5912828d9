"""What the communication model returns: collectives and the per-step volume (memfit.estimate.comm)."""

from __future__ import annotations

from dataclasses import dataclass

from .runtime import ALL_REDUCE, Runtime


# ------------------------------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class Collective:
    name: str
    """'all-reduce', 'reduce-scatter', 'all-gather' or 'broadcast'."""
    what: str
    num_elements: int
    """Elements of the whole buffer one call covers (Psi for the whole model)."""
    dtype_bytes: int
    calls_per_step: int = 1
    """Calls per optimizer step: the micro-steps, for what an engine does in every backward."""
    group: str = "data"
    """Which ranks take part: 'data' (the data-parallel ranks, or an HSDP shard group), 'replicate' (the HSDP
    replicas of one shard), 'tensor' (one tensor-parallel group), 'context' (one context-parallel group) or
    'pipeline' (point to point, stage to stage)."""

    @property
    def payload_bytes(self) -> int:
        """Bytes of the buffers covered per step: what memfit._torch.comm_count measures."""
        return self.num_elements * self.dtype_bytes * self.calls_per_step

    @property
    def volume_elements(self) -> int:
        return self.num_elements * self.calls_per_step * (2 if self.name == ALL_REDUCE else 1)

    @property
    def num_bytes(self) -> int:
        """Bytes each rank sends per step in the paper's convention (2x the payload for an all-reduce)."""
        return self.volume_elements * self.dtype_bytes

    def to_dict(self) -> dict:
        return {"name": self.name, "what": self.what, "elements": self.num_elements, "dtype_bytes": self.dtype_bytes,
                "calls_per_step": self.calls_per_step, "payload_bytes": self.payload_bytes, "bytes": self.num_bytes,
                "group": self.group}


@dataclass(frozen=True)
class CommVolume:
    """What each rank sends per optimizer step, split by collective (see the module docstring)."""

    collectives: tuple[Collective, ...]
    num_params: int
    world_size: int
    num_nodes: int = 1
    gpus_per_node: int = 1
    runtime: Runtime = Runtime.DDP
    notes: tuple[str, ...] = ()
    tp: int = 1
    """Tensor-parallel degree: world_size / tp data-parallel ranks; the 'tensor' collectives run inside a group."""
    pp: int = 1
    """Pipeline-parallel degree: world_size / (tp x pp) data-parallel ranks; 'pipeline' sends go stage to stage."""
    shard_size: int = 0
    """HSDP: the shard group the 'data' collectives run in (0: every data-parallel rank)."""

    @property
    def replicas(self) -> int:
        return max(1, self.dp_size // self.shard_size) if self.shard_size else 1

    @property
    def dp_size(self) -> int:
        """Ranks of the data-parallel collectives: world_size / (tp x pp), the context-parallel ranks included."""
        return max(1, self.world_size // (self.tp * self.pp))

    @property
    def per_rank_bytes(self) -> int:
        return sum(c.num_bytes for c in self.collectives)

    @property
    def data_parallel_bytes(self) -> int:
        return sum(c.num_bytes for c in self.collectives if c.group in ("data", "replicate"))

    @property
    def replicate_bytes(self) -> int:
        """HSDP: what each rank sends across the replicas (the gradient shards' all-reduce)."""
        return sum(c.num_bytes for c in self.collectives if c.group == "replicate")

    @property
    def tensor_parallel_bytes(self) -> int:
        """What each rank sends inside its tensor-parallel group per step (activations: B x T x h buffers)."""
        return sum(c.num_bytes for c in self.collectives if c.group == "tensor")

    @property
    def context_parallel_bytes(self) -> int:
        """What each rank sends inside its context-parallel group per step (ring attention's K/V and dK/dV)."""
        return sum(c.num_bytes for c in self.collectives if c.group == "context")

    @property
    def pipeline_parallel_bytes(self) -> int:
        """What the busiest pipeline rank sends to its neighbours per step (point to point, all of it on the wire)."""
        return sum(c.num_bytes for c in self.collectives if c.group == "pipeline")

    @property
    def ring_bytes_per_rank(self) -> int:
        """What a ring actually sends per rank: (N-1)/N of `per_rank_bytes`, N the ranks of each collective's group."""
        tp = self.tp
        data = self._ring_data_bytes()
        return (data + (self.tensor_parallel_bytes * (tp - 1) // tp if tp > 1 else 0)
                + self.pipeline_parallel_bytes + self.context_parallel_bytes)

    def _ring_data_bytes(self) -> int:
        """(N-1)/N of the data-parallel volume, N each collective's group: the shard group and the replicas."""
        shard, r = self.shard_size or self.dp_size, self.replicas
        inner = self.data_parallel_bytes - self.replicate_bytes
        return ((inner * (shard - 1) // shard if shard > 1 else 0)
                + (self.replicate_bytes * (r - 1) // r if r > 1 else 0))

    @property
    def psi_multiple(self) -> float:
        """Elements moved over P: 2 for the paper's DP and ZeRO-1/2, 3 for ZeRO-3 (see the docstring for engines);
        data-parallel collectives only, P one tensor-parallel rank's parameters."""
        data = sum(c.volume_elements for c in self.collectives if c.group in ("data", "replicate"))
        return data / self.num_params if self.num_params else 0.0

    def payload_bytes(self) -> dict[str, int]:
        """Payload bytes per collective name, comparable with memfit._torch.comm_count.CollectiveCounter."""
        totals: dict[str, int] = {}
        for c in self.collectives:
            totals[c.name] = totals.get(c.name, 0) + c.payload_bytes
        return totals

    @property
    def inter_node_bytes_per_node(self) -> int:
        """Bytes per step crossing each node's network link. A ring over all ranks, ordered by node, sends on every
        link what each rank sends, (N-1)/N of Psi per collective; one link out of each node crosses the network,
        so each node's link carries one rank's volume and the node-local links (NVLink) carry the rest. Tensor
        parallelism stays inside a node when tp divides the GPUs per node (else its traffic crosses too)."""
        if self.num_nodes < 2:
            return 0
        data = self._ring_data_bytes()
        if self.shard_size and self.shard_size * self.tp <= self.gpus_per_node:
            # HSDP with node-local shard groups: only the replicas' all-reduce leaves the node
            r = self.replicas
            data = self.replicate_bytes * (r - 1) // r if r > 1 else 0
        crossing_tp = self.tp > self.gpus_per_node
        # torchtitan's mesh order (pp, dp, tp): a stage boundary crosses nodes once tp x dp outgrows a node
        crossing_pp = self.pp > 1 and self.world_size // self.pp >= self.gpus_per_node
        return (data + (self.tensor_parallel_bytes * (self.tp - 1) // self.tp if crossing_tp else 0)
                + (self.pipeline_parallel_bytes if crossing_pp else 0))

    @property
    def inter_node_peer_fraction(self) -> float:
        """Share of each rank's peers on other nodes, (N - G) / (N - 1): the share of its traffic that would cross
        the network without a node-aware (ring or hierarchical) algorithm."""
        if self.world_size < 2:
            return 0.0
        return (self.world_size - self.gpus_per_node) / (self.world_size - 1)

    def to_dict(self) -> dict:
        return {"per_rank_bytes": self.per_rank_bytes, "ring_bytes_per_rank": self.ring_bytes_per_rank,
                "psi_multiple": self.psi_multiple, "runtime": self.runtime.value,
                "collectives": [c.to_dict() for c in self.collectives],
                "inter_node_bytes_per_node": self.inter_node_bytes_per_node,
                "inter_node_peer_fraction": self.inter_node_peer_fraction, "world_size": self.world_size,
                "tp": self.tp, "pp": self.pp, "shard_size": self.shard_size,
                "data_parallel_bytes": self.data_parallel_bytes, "replicate_bytes": self.replicate_bytes,
                "tensor_parallel_bytes": self.tensor_parallel_bytes,
                "pipeline_parallel_bytes": self.pipeline_parallel_bytes,
                "context_parallel_bytes": self.context_parallel_bytes,
                "num_nodes": self.num_nodes, "notes": list(self.notes)}
