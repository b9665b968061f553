"""Every example in the README and the guides in ``docs/`` runs as written, and every Trainer they show trains like
dense DDP.

The ``python`` blocks are read from the files: a block without a ``Trainer`` runs whole (in one namespace,
in order, as a reader would paste them); each ``Trainer(...)`` call is built on 2 ranks with the block's own imports,
given a small MLP (SGD with momentum 0.9 at lr 0.05, the optimizer users run) and trained. The README's examples are
held to what it promises, dense's held-out loss within 1%, unless the example's own line says what it ``trades``; the
guides' examples are held to dense's held-out accuracy within 2 points.

The default's choice follows the link it times, and a busy machine's loopback can time as a slow link: then it takes
local steps, whose held-out accuracy at this budget moves by about two points with where its rounds fall. So the
default here times a scripted 100 Mbit/s link (its slow-link path, one step sent, then rounds of local steps, taken
the same way on every run) rather than whatever the machine's load makes of the loopback.
"""

import ast
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

from lightning_gravac import GraVAC
from lightning_gravac.launch import run_distributed

from models import LinkOf, trainer_kwargs

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
STEPS = 160
#: How far above stock DDP's held-out loss a README example may end (a ratio), unless its line says what it trades.
LOSS_TOLERANCE = 1.01


def _blocks(pages: list[Path] = PAGES) -> list[str]:
    return [block for page in pages for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]


def _trainer_calls(block: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) == "Trainer" or getattr(node.func, "attr", None) == "Trainer")
    ]


def _examples(pages: list[Path] = PAGES) -> list[tuple[str, str]]:
    """``(the block's imports, one Trainer call)`` for every Trainer the pages build."""
    out = []
    for block in _blocks(pages):
        tree = ast.parse(block)
        imports = "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom))
        out += [(imports, ast.unparse(call)) for call in _trainer_calls(block)]
    return out


def _trading() -> set[str]:
    """The README's Trainer calls whose line says, in its comment, what the example ``trades``."""
    out = set()
    for block in _blocks([README]):
        lines = block.splitlines()
        for call in _trainer_calls(block):
            comment = lines[call.lineno - 1].partition("#")[2]
            if "trades" in comment:
                out.add(ast.unparse(call))
    return out


def test_the_readme_shows_trainers_and_plain_examples():
    assert len(_examples()) >= 3
    assert any(not _trainer_calls(b) for b in _blocks())


def test_the_guides_index_lists_every_page_in_one_item_and_every_local_link_resolves():
    index = ROOT / "docs" / "README.md"
    items = re.findall(r"^- \[(\w+\.md)\]\(\1\): ", index.read_text(), re.M)
    assert sorted(items) == sorted(p.name for p in PAGES[1:] if p != index)
    for page in [*PAGES, ROOT / "BENCHMARKS.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which is not there"


def test_every_readme_block_without_a_trainer_runs_as_written():
    namespace: dict[str, Any] = {"torch": torch}
    ran = 0
    for block in _blocks():
        if not _trainer_calls(block):
            exec(compile(block, str(README), "exec"), namespace)
            ran += 1
    assert ran


def _classes(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` Gaussian inputs of 32 features and one of 10 classes each, set by a fixed random two-layer teacher."""
    teacher = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(32, 64, generator=teacher), torch.randn(64, 10, generator=teacher)
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x @ w1 / 32**0.5) @ w2).argmax(1)


def _classifier(base: type, momentum: float) -> Any:
    """A 22K-parameter MLP classifier on :func:`_classes`, SGD at lr 0.05 with ``momentum``, for ``base`` (Lightning's
    ``LightningModule`` from either package)."""

    class Classifier(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                torch.nn.Linear(128, 10),
            )  # fmt: skip

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=momentum)

    return Classifier()


def _held_out(model: torch.nn.Module) -> tuple[float, float]:
    """``model``'s loss and accuracy on 2048 samples it was not trained on."""
    x, y = _classes(2048, seed=1)
    with torch.no_grad():
        logits = model(x)
        return torch.nn.functional.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def _train(imports: str, call: str | None, unified: bool) -> tuple[float, float]:
    """Build the Trainer ``call`` (``None``: stock DDP), fit the classifier for :data:`STEPS` steps, and return its
    held-out loss and accuracy."""
    if unified:
        import lightning.pytorch as trainer_pl
    else:
        trainer_pl = pl
    trainer_pl.seed_everything(0)
    kwargs: dict[str, Any] = {"strategy": DDPStrategy()}
    if call is not None:
        namespace: dict[str, Any] = {}
        exec(imports, namespace)

        def capture(**given: Any) -> dict[str, Any]:
            return given

        namespace.update(Trainer=capture, L=SimpleNamespace(Trainer=capture), pl=SimpleNamespace(Trainer=capture))
        kwargs = eval(call, namespace)
        # These ranks are launched like torchrun's: a strategy asked to spawn its own would start two more each.
        if getattr(kwargs.get("strategy"), "_start_method", "popen") != "popen":
            kwargs["strategy"]._start_method = "popen"
    # DGC applies the momentum itself and refuses an optimizer's: the same model, its momentum in DGC.
    dgc = getattr(getattr(kwargs.get("strategy"), "compressor", None), "name", "") == "dgc"
    model = _classifier(trainer_pl.LightningModule, momentum=0.0 if dgc else 0.9)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_classes(8192, seed=0)), batch_size=32,
                                       shuffle=True)  # fmt: skip
    trainer = trainer_pl.Trainer(**{**trainer_kwargs(2), **kwargs, "max_steps": STEPS})
    trainer.fit(model, data)
    return _held_out(model)


def _on_a_scripted_link() -> None:
    """The default controller (GraVAC's model search, where the method leaves a factor to choose) times a scripted
    100 Mbit/s link with steps of 5 ms of computation."""
    from lightning_gravac.strategies import default_controller

    chosen = default_controller._default_controller

    def scripted(method: Any, alone: bool) -> Any:
        controller = chosen(method, alone)
        return LinkOf(100e6, compute=0.005) if type(controller) is GraVAC else controller

    default_controller._default_controller = scripted


def _every_example(rank, world_size, examples):
    _on_a_scripted_link()
    losses = {"dense": _train("", None, unified=False)}
    for imports, call in examples:
        losses[call] = _train(imports, call, unified="L.Trainer" in call)
    return losses


def test_the_readme_opens_with_examples_that_keep_dense_loss():
    first = {ast.unparse(call) for call in _trainer_calls(_blocks([README])[0])}
    assert len(first) == 2 and not first & _trading()


@pytest.mark.distributed
@pytest.mark.slow
def test_every_trainer_in_the_readme_trains_to_dense_loss():
    r0, r1 = run_distributed(_every_example, examples=_examples(), timeout=600)
    dense_loss, dense = r0.pop("dense")
    print({call: (round(loss / dense_loss - 1, 4), round(acc - dense, 3)) for call, (loss, acc) in r0.items()})
    readme, trading = {call for _, call in _examples([README])}, _trading()
    for call, (loss, accuracy) in r0.items():
        if "model_averaging_period" not in call:  # local SGD's ranks differ between averages
            assert (loss, accuracy) == r1[call], f"{call}: the ranks hold different models"
        if call in trading:  # its line says what it trades
            assert math.isfinite(loss), f"{call}: held-out loss {loss}"
        elif call in readme:
            assert loss <= LOSS_TOLERANCE * dense_loss, f"{call}: held-out loss {loss:.4f}, dense DDP {dense_loss:.4f}"
        else:
            assert accuracy >= dense - 0.02, f"{call}: held-out accuracy {accuracy:.3f}, dense DDP {dense:.3f}"
