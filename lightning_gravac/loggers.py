"""Weights & Biases through Lightning's own WandbLogger, offline by itself when no API key is set up."""

import netrc
import os
from pathlib import Path
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_info
from pytorch_lightning.loggers import WandbLogger as _LightningWandbLogger
from pytorch_lightning.loggers.logger import rank_zero_experiment
from typing_extensions import override


def wandb_api_key_available() -> bool:
    """Whether W&B could authenticate: ``WANDB_API_KEY`` is set or ``wandb login`` left a key in ``~/.netrc``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        path = os.environ.get("NETRC", str(Path.home() / ".netrc"))
        return netrc.netrc(path).authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbLogger(_LightningWandbLogger):
    """Lightning's ``WandbLogger`` that logs offline, and says so, when no API key is available.

    With ``offline=None`` (the default) the run is online if a key is set up (``WANDB_API_KEY`` or ``wandb login``)
    and ``WANDB_MODE`` does not say otherwise, else offline under ``save_dir``; the log says how to upload it later
    with ``wandb sync``, in the one line that then replaces W&B's own three. W&B's own lines are quiet
    (``wandb.Settings(quiet=True)``: no tables of the run's history at its end; silent where this logger said it is
    offline; pass ``settings`` to choose). Everything else is Lightning's ``WandbLogger``.

    Args:
        offline: ``True`` or ``False`` to decide yourself; ``None`` to decide by the key.
        **kwargs: what Lightning's ``WandbLogger`` takes (``project``, ``name``, ``save_dir``, ``log_model``...).
    """

    def __init__(self, offline: bool | None = None, **kwargs: Any) -> None:
        said = False  # whether this logger said where the offline run goes
        if offline is None:
            offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not wandb_api_key_available()
            if offline:
                said = True
                where = Path(kwargs.get("save_dir") or kwargs.get("dir") or ".") / "wandb"
                rank_zero_info(
                    f"W&B: no API key found (WANDB_API_KEY or `wandb login`); logging offline to {where}. "
                    f"Upload the run later with: wandb sync {where}/offline-run-*"
                )
        self._run_dir = kwargs.get("save_dir") or kwargs.get("dir")
        if kwargs.get("settings") is None:  # the command line passes every argument of `wandb.init`, None if unset
            import wandb  # noqa: PLC0415 - Lightning's logger imports it on use too

            # Said, W&B's own lines repeat it ("syncing is set to offline", "saved locally", a terminal viewer's tip).
            kwargs["settings"] = wandb.Settings(quiet=True, silent=said)
        super().__init__(offline=offline, **kwargs)
        if kwargs.get("anonymous") is None:
            # Lightning passes `anonymous=None` to `wandb.init` whatever was asked, and W&B warns that the setting
            # has no effect whenever it is passed: leave it out unless the user set it (`_wandb_init` is Lightning's
            # own record of the arguments it will pass).
            self._wandb_init.pop("anonymous", None)

    @property
    @rank_zero_experiment
    @override
    def experiment(self) -> Any:
        """The W&B run, started on first use: its directory is made then, so that a run that fails before it logs
        (a refused argument, missing data) leaves none behind."""
        if self._experiment is None and self._run_dir:
            # W&B looks for a git repository there before creating it, and warns when it does not exist yet.
            Path(self._run_dir).mkdir(parents=True, exist_ok=True)
        return super().experiment
