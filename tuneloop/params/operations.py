"""The param groups of what runs beside the pipeline: the release (load test, shadow, fast
fail), serving, the watchdog and the schedule (``tuneloop.params`` puts them together)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from tuneloop.params.groups import _Group


class LoadTestParams(_Group):
    """The short load test of candidate against champion before the first traffic moves.

    Both answer ``max_tokens`` tokens exactly where the backend allows it, at the same
    concurrency, and are compared per token (``tuneloop/release/loadtest.py``).
    """

    enabled: bool = Field(description="false: skip it (the release records that it did)")
    requests: int = Field(ge=1, description="measured requests per backend, after 2 warm-ups")
    concurrency: int = Field(ge=1, description="requests in flight at once, the same for both")
    max_tokens: int = Field(ge=2, description="output tokens asked for (and forced) per request")
    max_ttft_ratio: float = Field(gt=0, description="candidate / champion median TTFT, at most")
    max_tpot_ratio: float = Field(
        gt=0, description="candidate / champion median time per output token, at most"
    )


class ShadowParams(_Group):
    """The shadow step's own thresholds (errors and latency use the canary's)."""

    min_pairs: int = Field(
        ge=1, description="mirrored requests answered by both arms that an analysis needs"
    )
    max_format_drop: float = Field(
        ge=0, le=1, description="challenger format compliance may trail the champion's this much"
    )


class FastFailParams(_Group):
    """A challenger error burst that the router itself rolls back on, between two analyses."""

    window: int = Field(ge=1, description="the last N challenger requests the router looks at")
    max_errors: int = Field(
        ge=1, description="5xx, connection errors and timeouts among them that roll back at once"
    )

    @model_validator(mode="after")
    def _fits_the_window(self) -> FastFailParams:
        if self.max_errors > self.window:
            raise ValueError(
                f"max_errors ({self.max_errors}) is more than the window ({self.window}): "
                "fast fail could never trigger"
            )
        return self


class ReleaseParams(_Group):
    """The release flow: canary steps, analysis thresholds, approvals (flows/release.py)."""

    routers: tuple[str, ...] = Field(
        min_length=1, description="base URL of every router replica; all are driven together"
    )
    admin_token_env: str = Field(min_length=1, description="env var holding the admin token")
    admin_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="seconds to wait for a router's admin answer (a page of samples included)",
    )
    steps: tuple[int, ...] = Field(min_length=1, description="challenger percents, rising to 100")
    analysis_interval: float = Field(gt=0, description="seconds of traffic per analysis")
    analyses_per_step: int = Field(ge=1, description="passing analyses before the next step")
    failure_limit: int = Field(ge=1, description="failed analyses that roll back by themselves")
    min_requests: int = Field(
        ge=1, description="requests per arm the error and badcase rate tests need"
    )
    min_latency_samples: int = Field(
        ge=1, description="answered requests per arm the latency test (Mann-Whitney) needs"
    )
    min_ttft_samples: int = Field(
        ge=1, description="streamed requests per arm the time-to-first-token test needs"
    )
    alpha: float = Field(
        gt=0, lt=1, description="a regression past its limit fails when its p-value is below this"
    )
    max_extensions: int = Field(
        ge=0, description="times an inconclusive analysis extends its interval before it fails"
    )
    max_error_rate_increase: float = Field(
        ge=0, le=1, description="challenger's error rate above the champion's, at most"
    )
    max_badcase_rate_increase: float = Field(
        ge=0, le=1, description="challenger's badcases per request above the champion's, at most"
    )
    max_latency_p99_ratio: float = Field(gt=0, description="challenger / champion p99, at most")
    max_ttft_p99_ratio: float = Field(gt=0, description="challenger / champion p99, at most")
    approval_timeout: int = Field(ge=1, description="seconds to wait for a person; then rollback")
    # At least 2 s: the flow renews every third of it, and each renewal is an HTTP call.
    lease_ttl_s: float = Field(
        ge=2, description="a release silent this long is rolled back by every router on its own"
    )
    shadow_percent: int = Field(
        ge=0, le=100, description="users mirrored to the challenger in a shadow step first; 0: none"
    )
    shadow: ShadowParams
    fast_fail: FastFailParams
    loadtest: LoadTestParams

    @model_validator(mode="after")
    def _steps_rise_to_100(self) -> ReleaseParams:
        steps = self.steps
        if any(not 1 <= s <= 100 for s in steps) or list(steps) != sorted(set(steps)):
            raise ValueError(f"steps must rise strictly within [1, 100] (got {list(steps)})")
        if steps[-1] != 100:
            raise ValueError(f"steps must end at 100, where the candidate is promoted ({steps})")
        return self


# The ranks vLLM's LoRA kernels take, for --max-lora-rank and for every adapter's rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ServeParams(_Group):
    """``tuneloop serve``: the engine behind each arm (``tuneloop/release/serve.py``).

    Not a DVC param of any stage: it decides how a model is served, not what the model is.
    """

    engine: Literal["auto", "vllm", "transformers"] = Field(
        description="auto: vLLM where its environment is built (make serve-setup), else "
        "transformers serve"
    )
    venv: Path = Field(description="vLLM's own environment, built by make serve-setup")
    max_model_len: int | None = Field(
        ge=16, description="tokens per sequence vLLM serves; null = the model's own context"
    )
    cpu_kv_cache_gib: int = Field(
        ge=1, description="VLLM_CPU_KVCACHE_SPACE on a CPU host; unset, vLLM takes most RAM"
    )
    cpu_threads: int | None = Field(
        ge=1,
        description="OMP_NUM_THREADS of a backend on a CPU host (vLLM or transformers serve); "
        "null = every core",
    )
    max_lora_rank: int = Field(
        description=f"vLLM's --max-lora-rank when adapters are served, one of {VLLM_LORA_RANKS}"
    )
    max_loras: int = Field(ge=1, description="adapters vLLM holds in one batch (--max-loras)")

    @field_validator("max_lora_rank")
    @classmethod
    def _a_vllm_rank(cls, rank: int) -> int:
        if rank not in VLLM_LORA_RANKS:
            raise ValueError(f"vLLM takes a max LoRA rank of {list(VLLM_LORA_RANKS)}")
        return rank


class WatchdogParams(_Group):
    """The power/heartbeat watchdog the train stage runs beside itself (``tuneloop.telemetry``).

    Not a DVC param of any stage: it watches a run, it does not change what the run makes.
    """

    enabled: bool = Field(description="false: train runs without its watchdog")
    deadlock_after_s: float = Field(
        gt=0, description="no step (and low GPU power) this long outside a checkpoint = a hang"
    )
    window_s: float = Field(ge=5, description="classification window; NVML power is an average")
    hz: float = Field(ge=1, le=10, description="GPU samples per second")
    kill_grace_s: float = Field(ge=0, description="SIGTERM, then SIGKILL after this long")
    section_max_factor: float = Field(
        ge=1, description="a checkpoint/eval longer than this x deadlock_after_s is a hang too"
    )
    starvation_warn_s: float = Field(gt=0, description="sustained data-starvation before a warning")
    calibration: Path | None = Field(
        default=None, description="calibration JSON for these GPUs; null = matched by GPU name"
    )


class QueueParams(_Group):
    priority: int = Field(ge=1, description="lower is served first")
    concurrency: int | None = Field(ge=1, description="runs at once from this queue; null = any")


class PoolParams(_Group):
    concurrency: int | None = Field(ge=1, description="runs at once on the pool; null = any")
    queues: dict[str, QueueParams] = Field(
        min_length=1, description="the pool's work queues by name (night, day, release)"
    )


class ScheduleParams(_Group):
    """Prefect: the monthly schedule and the work pools it runs on (``tuneloop deploy``)."""

    cron: str = Field(description="retrain-monthly's cron, read in `timezone`")
    timezone: str = Field(description="IANA time zone name, e.g. Asia/Shanghai")
    heartbeat_s: int = Field(
        ge=30, description="seconds between a flow run's heartbeats (Prefect's minimum is 30)"
    )
    crash_after_s: int = Field(
        description="a flow run silent this long is marked Crashed; at least 2 x heartbeat_s"
    )
    pools: dict[str, PoolParams] = Field(
        min_length=1, description="Prefect work pools by name; one worker per pool and host"
    )
    commit_results: bool = Field(
        description="commit dvc.lock and metrics/ after each retrain to branch tuneloop/results "
        "(tag retrain-<time>), so `dvc metrics diff` compares months; the checkout is untouched"
    )
    dvc_lock_wait_s: float = Field(
        ge=0, description="how long a flow's dvc call waits for another dvc command's lock"
    )

    @field_validator("cron")
    @classmethod
    def _five_fields(cls, cron: str) -> str:
        if len(cron.split()) != 5:
            raise ValueError("a cron has five fields: minute hour day-of-month month day-of-week")
        return cron

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, name: str) -> str:
        try:
            ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError("not an IANA time zone name (e.g. Asia/Shanghai, UTC)") from None
        return name

    @model_validator(mode="after")
    def _two_heartbeats_missed(self) -> ScheduleParams:
        # One late heartbeat (a busy host, a slow server) must not crash a healthy run.
        if self.crash_after_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"crash_after_s ({self.crash_after_s}) must be at least 2 x heartbeat_s "
                f"({2 * self.heartbeat_s}): one late heartbeat would crash a healthy run"
            )
        return self


class ClusterParams(_Group):
    """Where ``train.launcher`` slurm or kubernetes runs the ranks (``tuneloop.cluster``).

    Not a DVC param: it says where the ranks run, not what they make; ``nodes`` x
    ``gpus_per_node`` must be ``batch.world_size`` (a DVC param), checked when params load.
    """

    nodes: int = Field(ge=1, description="machines the job spans; one task (watchdog) per node")
    gpus_per_node: int = Field(ge=1, description="ranks on each node (torchrun --nproc-per-node)")
    partition: str | None = Field(
        default=None, description="Slurm partition; null = the cluster's default"
    )
    account: str | None = Field(default=None, description="Slurm account; null = the user's")
    time_limit: str = Field(
        pattern=r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$",
        description="the job's wall-time limit, as Slurm writes it (D-HH:MM:SS, HH:MM:SS, MM)",
    )

    @field_validator("time_limit", mode="before")
    @classmethod
    def _sexagesimal(cls, value: object) -> object:
        """YAML 1.1 reads an unquoted 12:00:00 as 43200 (base 60), and `dvc exp run -S`
        writes params.yaml back without the quotes: seconds become H:MM:SS again."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            hours, rest = divmod(value, 3600)
            return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
        return value

    signal_before_end_s: int = Field(
        ge=10,
        description="Slurm sends USR1 this long before the time limit: the ranks checkpoint and "
        "the job is requeued (--signal=B:USR1@s)",
    )
    rendezvous_port: int = Field(ge=1024, le=65535, description="c10d on the first node")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="variables set for every rank (NCCL_*, MLFLOW_*), beside the submitter's own",
    )
    extra_args: tuple[str, ...] = Field(
        default=(), description="more scheduler arguments, e.g. ['--qos=high', '--exclusive']"
    )
    poll_s: float = Field(gt=0, description="how often the stage asks the scheduler for state")
    image: str | None = Field(
        default=None, description="kubernetes: the container image the project's Dockerfile built"
    )
    namespace: str = Field(default="default", description="kubernetes: the TrainJob's namespace")
    queue: str | None = Field(
        default=None,
        description="kubernetes: Kueue's LocalQueue (label kueue.x-k8s.io/queue-name); "
        "null = not gang-scheduled through Kueue",
    )
    runtime: str = Field(
        default="torch-distributed",
        description="kubernetes: the ClusterTrainingRuntime the TrainJob references",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not name.replace("_", "a").isalnum() or name[0].isdigit():
                raise ValueError(f"{name!r} is no environment variable name")
        return env
