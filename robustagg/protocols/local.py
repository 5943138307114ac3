"""``protocol=local``: rounds of local training with client sampling (FedAvg and its adaptive variants).

One update of the trainer is one *round*: ``k`` of the ``n`` clients are sampled, each runs ``K``
steps of its own local optimizer from the round's model on its own batches, submits its model
delta ``w_K - w_round``, and the server optimizer steps with the pseudo-gradient
``-aggregate`` (the robust aggregate of the deltas). With server SGD at learning rate 1 this is
FedAvg (McMahan, Moore, Ramage, Hampson, Agüera y Arcas, AISTATS 2017, Algorithm 1, with the
mean replaced by the robust rule); with Adam or Yogi on the server it is FedAdam / FedYogi
(Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan, ICLR 2021, Algorithm 2).
"""

from __future__ import annotations

import copy
import math
from functools import partial
from typing import Any, Callable, ClassVar, Iterable, Optional

import torch

from .._tensor import flatten
from ..errors import ConfigError
from ..training.sampler import ShardSampler, mix_seed
from .base import Protocol, RoundPlan, Trainer

__all__ = ["LocalRounds", "sample_clients", "rule_f"]

#: ``params -> torch.optim.Optimizer`` (e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``).
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

_SAMPLING = ("uniform", "all")
_CLIENT_STATE = ("reset", "keep")
_ROUND_SALT = 0x10CA1


def sample_clients(n: int, k: int, *, seed: int, round_id: int) -> tuple[int, ...]:
    """The ``k`` clients of round ``round_id``: uniform without replacement, ascending.

    Definition: the first ``k`` entries of ``torch.randperm(n)`` under a CPU generator seeded with
    ``mix_seed(seed, round_id, 0x10CA1)``, sorted. Every subset of size ``k`` has probability
    ``1 / C(n, k)``; the draw depends on ``(seed, round_id)`` only, so every process computes it
    without a collective and a resumed run draws the same clients.

    Args:
        n: number of clients (>= 1). k: clients per round, ``1 <= k <= n``.
        seed: the run's seed. round_id: the 0-based round (the trainer's step).

    Returns:
        ``k`` distinct client ranks in ``[0, n)``, ascending.

    Raises:
        ConfigError: ``k`` outside ``[1, n]`` (names ``protocol.clients_per_round``).

    Example:
        >>> a = sample_clients(10, 3, seed=0, round_id=7)
        >>> a == sample_clients(10, 3, seed=0, round_id=7), len(set(a)), a == tuple(sorted(a))
        (True, 3, True)
    """
    if not 1 <= int(k) <= int(n):
        raise ConfigError(f"protocol.clients_per_round must be in [1, n={n}]; got {k}. Lower it to at most threat.n, "
                          "or use protocol.sampling=all.")
    g = torch.Generator().manual_seed(mix_seed(int(seed), int(round_id), _ROUND_SALT))
    return tuple(sorted(int(i) for i in torch.randperm(int(n), generator=g)[: int(k)].tolist()))


def rule_f(rule: Any) -> int:
    """The declared ``f`` of a rule, or of a Pipeline's final rule (0 when it declares none)."""
    final = getattr(rule, "rule", rule)
    return int(getattr(final, "f", 0) or 0)


class LocalRounds(Protocol):
    """Rounds of local training with client sampling; the server applies the robust aggregate of the deltas.

    Per round ``t`` (one trainer update), on the round's model ``w_t`` (parameters and buffers):

    1. ``S_t``: :func:`sample_clients` (``sampling="uniform"``, ``k = clients_per_round``) or every
       client (``sampling="all"``).
    2. Each client ``i`` in ``S_t`` (on the process hosting it) runs ``K`` steps of its local
       optimizer from ``w_t`` on its own next batches (``trainer.worker_batch``: a Byzantine
       client's batches are poisoned under a data attack) with its own torch RNG stream, and
       submits ``Δ_i = w_{t,K}^i - w_t``: ``(d,)``, the parameters' dtype, flattened like
       :func:`torch.nn.utils.parameters_to_vector`. ``K = local_steps``, or with ``local_epochs = E``
       ``K_i = ceil(E * |shard_i| / b_i)`` (``b_i = min(batch_size, |shard_i|)``). Its reported
       loss is the mean training loss of its ``K`` local steps. The model (parameters and buffers)
       is then restored to ``w_t`` before the next hosted client: buffers (e.g. BatchNorm running
       statistics) are not aggregated and stay at the round's value.
    3. Integrity, omniscient attacks (they see the sampled honest deltas only) and the rule on the
       ``k`` rows: ``Δ = rule(Δ_i, i in S_t)``.
    4. The server optimizer (the trainer's ``optimizer``; build it with
       :meth:`server_optimizer_for`) steps with gradient ``-Δ``; the trainer's scheduler, if any,
       steps once per round.

    Server optimizers: ``torch.optim.SGD(lr=1)`` is FedAvg's ``w <- w + Δ``; ``torch.optim.Adam``
    stands in for FedAdam and ``torch.optim.Adagrad`` for FedAdagrad (Reddi et al., ICLR 2021,
    Algorithm 2; torch's Adam adds bias correction, which that algorithm omits, and its ``eps`` is
    the paper's ``τ``). FedYogi needs a Yogi optimizer (torch has none): pass any optimizer class
    with torch's calling convention by ``_target_``.

    Guarantees: the rule's requirement is checked at ``k`` rows with the rule's ``f`` before the
    run (``experiments.wiring.validate``) and at every round; every round records how many sampled
    clients were Byzantine (``round/byzantine``) and whether that exceeded the rule's ``f``
    (``round/over_f``: a round without the rule's guarantee). Simulated and multi-process runs are
    bit-identical, and a resumed run is bit-equal to an uninterrupted one (the sample depends on
    ``(seed, round)`` only; each client's data position, RNG stream and, under
    ``client_state="keep"``, local optimizer state are checkpointed under its worker id).

    Gives up: the number of Byzantine clients per round is random (hypergeometric with mean
    ``k b / n`` for ``b`` Byzantine clients), so some rounds lack the guarantee; local steps on
    non-IID shards drift each client toward its own optimum (client drift: Karimireddy et al.,
    SCAFFOLD, ICML 2020), so even the honest mean of the deltas is a biased step of the global
    objective (``agg/bias_vs_sync`` measures it against the mean over all honest clients).
    Cost: ``K`` forward/backward passes per sampled client per round, ``k d`` exchanged values.

    Assumption: the rule's requirement at ``(k, f)`` with ``f`` the rule's declared bound, and at
    most ``f`` Byzantine clients among the sampled ones in the rounds one relies on.

    Args:
        clients_per_round: ``k``, sampled per round (``sampling="uniform"``; ignored under ``"all"``).
        sampling: ``"uniform"`` (``k`` without replacement, seeded by ``(seed, round)``) or ``"all"``.
        local_steps: ``K >= 1`` local optimizer steps per sampled client.
        local_epochs: ``E > 0`` passes over the client's shard instead (``None``: use
            ``local_steps``); needs in-memory shards.
        client_state: ``"reset"`` (a fresh local optimizer every round) or ``"keep"`` (each
            client's local optimizer state persists across its rounds and is checkpointed).
        server_optimizer: ``params -> Optimizer`` for the server (default SGD, lr 1: FedAvg).
        client_optimizer: ``params -> Optimizer`` for the clients' local steps (the apps pass the
            top-level ``optimizer`` group); required before :meth:`bind`.

    Raises:
        ConfigError: a setting out of range (the message names ``protocol.<key>`` and the fix).
    """

    name: ClassVar[str] = "local"
    #: An elastic shrink would renumber the clients the rounds sample from: not supported (refused before launch).
    shrinkable: ClassVar[bool] = False
    gathers: ClassVar[bool] = True

    def __init__(self, *, clients_per_round: int = 10, sampling: str = "uniform", local_steps: int = 1,
                 local_epochs: Optional[float] = None, client_state: str = "reset",
                 server_optimizer: Optional[OptimizerFactory] = None,
                 client_optimizer: Optional[OptimizerFactory] = None) -> None:
        if sampling not in _SAMPLING:
            raise ConfigError(f"protocol.sampling must be uniform or all; got {sampling!r}.")
        if client_state not in _CLIENT_STATE:
            raise ConfigError(f"protocol.client_state must be reset or keep; got {client_state!r}.")
        if isinstance(clients_per_round, bool) or not isinstance(clients_per_round, int) or clients_per_round < 1:
            raise ConfigError(f"protocol.clients_per_round must be an integer >= 1; got {clients_per_round!r}.")
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ConfigError(f"protocol.local_steps must be an integer >= 1; got {local_steps!r}.")
        if local_epochs is not None and not (isinstance(local_epochs, (int, float)) and not isinstance(local_epochs, bool)
                                             and math.isfinite(local_epochs) and local_epochs > 0):
            raise ConfigError(f"protocol.local_epochs must be a finite number > 0 or null (then local_steps is used); "
                              f"got {local_epochs!r}.")
        if server_optimizer is not None and not callable(server_optimizer):
            raise ConfigError("protocol.server_optimizer must be an optimizer factory (a _target_ node with "
                              "_partial_: true, e.g. torch.optim.SGD with lr 1.0).")
        self.clients_per_round = int(clients_per_round)
        self.sampling = str(sampling)
        self.local_steps = int(local_steps)
        self.local_epochs = None if local_epochs is None else float(local_epochs)
        self.client_state = str(client_state)
        self.server_optimizer: OptimizerFactory = server_optimizer or partial(torch.optim.SGD, lr=1.0)
        self.client_optimizer = client_optimizer
        self._steps: dict[int, int] = {}  # hosted rank -> local steps
        self._opt_state: dict[int, Optional[dict[str, Any]]] = {}  # hosted rank -> local optimizer state (keep)
        self._rows: dict[int, torch.Tensor] = {}  # this round's submitted deltas (for the reference)

    # --- settings ---------------------------------------------------------------------------------
    def rows_per_update(self, n: int) -> int:
        """How many rows the rule receives per round with ``n`` clients (``k``, or ``n`` under ``all``).

        Raises:
            ConfigError: ``clients_per_round > n`` under ``sampling="uniform"``.
        """
        if self.sampling == "all":
            return int(n)
        if self.clients_per_round > n:
            raise ConfigError(f"protocol.clients_per_round={self.clients_per_round} exceeds the n={n} clients; lower "
                              "it to at most threat.n, or use protocol.sampling=all.")
        return self.clients_per_round

    def server_optimizer_for(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The server optimizer over ``params`` (hand it to the Trainer as its ``optimizer``).

        Raises:
            ConfigError: the factory fails or builds something that is not a torch Optimizer.
        """
        try:
            opt = self.server_optimizer(params)
        except Exception as exc:
            raise ConfigError(f"protocol.server_optimizer could not be built: {exc}".replace("\n", " ")) from None
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"protocol.server_optimizer built {type(opt).__name__}, not a torch.optim.Optimizer.")
        return opt

    def bind(self, trainer: Trainer) -> None:
        """Size the hosted clients' state and check the setting (see :meth:`Protocol.bind`).

        Raises:
            ConfigError: no client optimizer, worker momentum on, ``k > n``, or ``local_epochs``
                with a shard whose size is unknown.
        """
        if self.client_optimizer is None:
            raise ConfigError("protocol=local needs the clients' local optimizer (client_optimizer: params -> "
                              "Optimizer; the apps pass the optimizer group).")
        if trainer.worker_momentum > 0:
            raise ConfigError(f"trainer.worker_momentum={trainer.worker_momentum} has no meaning under protocol=local "
                              "(clients submit model deltas, not gradients); set trainer.worker_momentum=0 and give "
                              "the local optimizer momentum (optimizer.momentum=0.9) or the server one "
                              "(protocol.server_optimizer.momentum).")
        self.rows_per_update(trainer.comm.world_size)
        self._steps, self._opt_state = {}, {}
        for r in trainer.comm.local_ranks:
            self._steps[r] = self._local_steps_of(trainer, r)
            self._opt_state[r] = None

    def _local_steps_of(self, trainer: Trainer, rank: int) -> int:
        if self.local_epochs is None:
            return self.local_steps
        sampler = trainer.samplers[rank]
        if not isinstance(sampler, ShardSampler):
            raise ConfigError(f"protocol.local_epochs needs in-memory shards (worker {rank}'s data is a stream of "
                              "unknown length); use protocol.local_steps instead.")
        return max(1, math.ceil(self.local_epochs * sampler.size / sampler.batch))

    def describe(self) -> dict[str, Any]:
        """``protocol`` and its settings (for the summary)."""
        return {"protocol": self.name, "clients_per_round": self.clients_per_round, "sampling": self.sampling,
                "local_steps": self.local_steps, "local_epochs": self.local_epochs, "client_state": self.client_state}

    # --- one round ----------------------------------------------------------------------------------
    def plan(self, trainer: Trainer, step: int) -> RoundPlan:
        """The sampled clients of round ``step`` and the round's numbers (``round/*``)."""
        n = trainer.comm.world_size
        members = tuple(range(n)) if self.sampling == "all" else sample_clients(
            n, self.clients_per_round, seed=trainer.seed, round_id=step)
        byz = trainer.byzantine
        b = sum(1 for r in byz.ranks if r in members) if byz is not None and byz.active(step) else 0
        info = {"round/participants": len(members), "round/byzantine": b,
                "round/over_f": int(b > rule_f(trainer.reduction.rule))}
        self._rows = {}
        return RoundPlan(step=step, members=members, full=len(members) == n, info=info)

    def _run_client(self, trainer: Trainer, rank: int, step: int,
                    state: Optional[dict[str, Any]]) -> tuple[torch.Tensor, float, dict[str, Any]]:
        """Client ``rank``'s local training from the current (round's) model; the model is restored after.

        Consumes the client's batches and RNG stream; returns ``(delta, mean loss, optimizer state)``.
        """
        model, params = trainer.model, trainer.params
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        w0 = flatten([p.detach() for p in params])
        assert self.client_optimizer is not None  # bind checked it
        opt = self.client_optimizer(params)
        if state is not None:
            opt.load_state_dict(copy.deepcopy(state))  # torch may keep the given tensors: never share them
        torch.set_rng_state(trainer.worker_rng[rank])
        losses = []
        try:
            for _ in range(self._steps[rank]):
                _, loss = trainer._gradient(trainer.worker_batch(rank, step), rank)  # under trainer.precision
                opt.step()
                losses.append(loss)
            trainer.worker_rng[rank] = torch.get_rng_state()
            delta = flatten([p.detach() for p in params]) - w0
            new_state = opt.state_dict()
        finally:
            model.load_state_dict(snapshot)  # in place: the server optimizer keeps its parameters
            for p in params:
                p.grad = None
        return delta, sum(losses) / len(losses), new_state

    def submit(self, trainer: Trainer, rank: int, plan: RoundPlan) -> tuple[torch.Tensor, float]:
        """Client ``rank``'s model delta after its local steps from the round's model, and its mean loss."""
        delta, loss, state = self._run_client(trainer, rank, plan.step, self._opt_state.get(rank))
        if self.client_state == "keep":
            self._opt_state[rank] = state
        if trainer.measure_bias:
            self._rows[rank] = delta.clone()
        return delta, loss

    def apply(self, trainer: Trainer, aggregate: torch.Tensor, plan: RoundPlan) -> None:
        """The server optimizer (and scheduler) step with pseudo-gradient ``-aggregate``."""
        trainer.apply(-aggregate)

    def reference(self, trainer: Trainer, plan: RoundPlan, reduced: Any,
                  byzantine: tuple[int, ...]) -> Optional[torch.Tensor]:
        """The mean over every honest client of the delta it would submit from this round's model ``(d,)`` float64.

        A sampled client's delta is its submission; every other honest client trains from the
        round's model on the batches it would draw next, and its data position, RNG stream and
        local optimizer state are put back afterwards (as is the process's torch RNG), so measuring
        the bias does not change the run. Honest: every client when no attack is active this
        round, else the clients outside ``byzantine.ranks``. ``None`` unless this process hosts
        every client (the simulated mode).
        """
        n = trainer.comm.world_size
        if sorted(trainer.comm.local_ranks) != list(range(n)):
            return None
        byz = trainer.byzantine
        excluded = set(byz.ranks) if byz is not None and byz.active(plan.step) else set()
        saved = torch.get_rng_state()
        rows = []
        try:
            for r in range(n):
                if r in excluded:
                    continue
                if r in self._rows:
                    rows.append(self._rows[r].to(torch.float64))
                    continue
                position, rng = copy.deepcopy(trainer.samplers[r].state_dict()), trainer.worker_rng[r].clone()
                try:
                    delta, _, _ = self._run_client(trainer, r, plan.step, self._opt_state.get(r))
                finally:
                    trainer.samplers[r].load_state_dict(position)
                    trainer.worker_rng[r] = rng
                rows.append(delta.to(torch.float64))
        finally:
            torch.set_rng_state(saved)
        return torch.stack(rows).mean(dim=0) if rows else None

    # --- state ---------------------------------------------------------------------------------------
    def worker_state(self, rank: int) -> dict[str, Any]:
        """``{"optimizer": state}`` of client ``rank``'s local optimizer under ``client_state="keep"``
        once it has trained (``{}`` otherwise)."""
        state = self._opt_state.get(rank)
        return {} if state is None else {"optimizer": state}

    def load_worker_state(self, rank: int, state: dict[str, Any]) -> None:
        """Restore :meth:`worker_state` output for hosted client ``rank``."""
        opt = (state or {}).get("optimizer")
        self._opt_state[rank] = None if opt is None else copy.deepcopy(opt)
