"""The recipes' models and data: real-format files the tests write, synthetic modes, transforms, shapes."""

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_gravac.zoo import CIFARDataModule, ImageClassifier, LSTMLanguageModel, PTBDataModule, SyntheticImages
from lightning_gravac.zoo.cifar import ARCHIVES, read_split
from lightning_gravac.zoo.language import Streams, rank_loader, read_tokens, synthetic_stream
from lightning_gravac.zoo.transforms import normalize, random_crop, random_flip
from lightning_gravac.zoo.vision import resnet, vgg


def _write_cifar(root, variant, per_file=4):
    """A CIFAR archive's extracted files in the real format: pickled dicts of uint8 rows and labels."""
    archive = ARCHIVES[variant]
    folder = root / archive.folder
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for name in (*archive.train, archive.test):
        data = rng.integers(0, 256, (per_file, 3072), dtype=np.uint8)
        labels = rng.integers(0, archive.classes, per_file).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, archive.label_key: labels, b"batch_label": b"x"}, f)
        written[name] = (data, labels)
    return written


@pytest.mark.parametrize("variant", ["cifar10", "cifar100"])
def test_cifar_reads_the_python_pickle_archives(tmp_path, variant):
    written = _write_cifar(tmp_path, variant)
    images, labels = read_split(tmp_path, variant, train=True)
    archive = ARCHIVES[variant]
    assert images.shape == (4 * len(archive.train), 3, 32, 32) and images.dtype == torch.uint8
    first, first_labels = written[archive.train[0]]
    # Rows are channel-major: the first 1024 bytes are the red plane.
    assert torch.equal(images[0, 0].reshape(-1), torch.from_numpy(first[0, :1024]))
    assert labels[:4].tolist() == first_labels
    test_images, _ = read_split(tmp_path, variant, train=False)
    assert test_images.shape[0] == 4

    data = CIFARDataModule(variant, root=str(tmp_path), batch_size=2)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32 and data.num_classes == archive.classes
    assert y.dtype == torch.int64


def test_cifar_without_files_names_the_expected_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py/data_batch_1.*download: true.*synthetic: true"):
        read_split(tmp_path, "cifar10", train=True)


def test_synthetic_cifar_has_the_real_shapes_sizes_and_is_reproducible():
    data = CIFARDataModule("cifar100", synthetic=True, batch_size=8)
    data.setup("fit")
    assert len(data.train_set) == 50_000 and len(data.test_set) == 10_000 and data.num_classes == 100
    a, b = SyntheticImages(10, 100)[3], SyntheticImages(10, 100)[3]
    assert a[0].shape == (3, 32, 32) and a[0].dtype == torch.uint8 and torch.equal(a[0], b[0]) and a[1] == b[1]


def test_transforms_crop_flip_normalize():
    image = torch.arange(3 * 4 * 4, dtype=torch.uint8).view(3, 4, 4)
    crops = {tuple(random_crop(image, 4, 1, torch.Generator().manual_seed(s)).flatten().tolist()) for s in range(30)}
    assert len(crops) > 1 and all(len(c) == 48 for c in crops)
    assert torch.equal(random_crop(image, 4, 0), image)
    flips = {random_flip(image, torch.Generator().manual_seed(s)).equal(image.flip(-1)) for s in range(20)}
    assert flips == {True, False}
    out = normalize(torch.full((3, 2, 2), 255, dtype=torch.uint8), (0.5, 0.5, 0.5), (0.25, 0.5, 1.0))
    assert out[:, 0, 0].tolist() == [2.0, 1.0, 0.5]


@pytest.mark.parametrize(("build", "name", "params"), [(resnet, "resnet18", 11.2e6), (vgg, "vgg11_bn", 9.2e6)])
def test_cifar_networks_classify_32x32_images(build, name, params):
    net = build(name, 10)
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert sum(p.numel() for p in net.parameters()) == pytest.approx(params, rel=0.02)


def test_resnet101_and_vgg16_have_their_known_sizes():
    assert sum(p.numel() for p in resnet("resnet101", 10).parameters()) == pytest.approx(42.5e6, rel=0.01)
    assert sum(p.numel() for p in vgg("vgg16_bn", 100).parameters()) == pytest.approx(14.8e6, rel=0.01)
    with pytest.raises(ValueError, match=r"Unknown architecture 'resnet7'"):
        ImageClassifier("resnet7")


def _write_ptb(root):
    root.mkdir()
    lines = {"train": ["the cat sat", "a dog ran far", "the dog sat"], "valid": ["the cat ran"], "test": ["a cat"]}
    for split, text in lines.items():
        (root / f"ptb.{split}.txt").write_text("".join(f" {line} \n" for line in text))


def test_ptb_reads_the_text_files_with_eos(tmp_path):
    _write_ptb(tmp_path / "ptb")
    assert read_tokens(tmp_path / "ptb" / "ptb.valid.txt") == ["the", "cat", "ran", "<eos>"]
    data = PTBDataModule(root=str(tmp_path / "ptb"), batch_size=2, bptt=3)
    data.setup("fit")
    assert data.vocab_size == 8  # the cat sat <eos> a dog ran far
    assert data.splits["train"][:4].tolist() == [0, 1, 2, 3]
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (2, 3) and torch.equal(x[:, 1:], y[:, :-1])


def test_ptb_without_files_names_the_expected_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"expected .*ptb.train.txt.*synthetic: true"):
        PTBDataModule(root=str(tmp_path)).setup("fit")


def test_streams_run_in_order_so_the_hidden_state_can_carry():
    stream = torch.arange(2 * 10 + 1)
    windows = list(Streams(stream, rows=2, bptt=4))
    assert [w[0].tolist() for w in windows] == [[[0, 1, 2, 3], [10, 11, 12, 13]], [[4, 5, 6, 7], [14, 15, 16, 17]],
                                                [[8, 9], [18, 19]]]  # fmt: skip
    assert windows[-1][1].tolist() == [[9, 10], [19, 20]]  # row r reads tokens 10r.. and predicts the next
    assert len(Streams(stream, rows=2, bptt=4)) == 3


def test_each_rank_reads_its_own_share_in_order_through_a_distributed_sampler():
    stream = torch.arange(2 * (2 * 10) + 1)
    for rank in (0, 1):
        loader = rank_loader(stream, world=2, rank=rank, rows=2, bptt=4)
        own = Streams(stream[rank * 20 : (rank + 1) * 20 + 1], rows=2, bptt=4)
        assert isinstance(loader.sampler, DistributedSampler)  # Lightning adds none of its own then
        assert len(loader) == len(own) == 3
        for (x, y), (x_own, y_own) in zip(loader, own, strict=True):
            assert torch.equal(x, x_own) and torch.equal(y, y_own)
    assert next(iter(rank_loader(stream, world=2, rank=1, rows=2, bptt=4)))[0][0, 0] == 20
    # 24 tokens: the second share is a token short, a window fewer; both ranks read as many as it has.
    short = [len(rank_loader(torch.arange(24), world=2, rank=r, rows=2, bptt=4)) for r in (0, 1)]
    assert short == [1, 1] and [len(list(rank_loader(torch.arange(24), 2, r, 2, 4))) for r in (0, 1)] == [1, 1]


def test_synthetic_ptb_has_its_sizes_and_vocabulary():
    data = PTBDataModule(synthetic=True, synthetic_tokens=80_000)
    data.setup("fit")
    assert data.vocab_size == 10_000 and data.splits["train"].numel() == 80_000
    assert data.splits["valid"].numel() == 80_000 * 73_760 // 929_589
    assert not torch.equal(data.splits["valid"][:100], data.splits["train"][:100])
    assert synthetic_stream(100, 50, 3).max() < 50


def test_lstm_carries_its_hidden_state_across_batches_and_ties_weights():
    model = LSTMLanguageModel(vocab_size=50, embedding=16, hidden=16, dropout=0.0)
    assert model.decoder.weight is model.encoder.weight
    batch = (torch.randint(0, 50, (3, 5)), torch.randint(0, 50, (3, 5)))
    _, loss = model._step(batch, "train")
    assert loss.item() == pytest.approx(np.log(50), rel=0.1)  # small embeddings: near-uniform first predictions
    carried = model._hidden["train"]
    assert carried is not None and carried[0].shape == (2, 3, 16) and not carried[0].requires_grad
    logits, state = model(batch[0], carried)
    assert logits.shape == (3, 5, 50) and state[0].shape == carried[0].shape
    with pytest.raises(ValueError, match="Tied weights need `embedding` == `hidden`"):
        LSTMLanguageModel(vocab_size=5, embedding=8, hidden=16)


def test_large_minibatch_schedule_scales_linearly_and_warms_up():
    # Goyal et al.: 8 ranks x 32 = 256 against a reference of 32: 8x the rate, reached linearly over 2 epochs of
    # 10 steps; then x0.1 at epoch 5.
    from lightning_gravac.zoo.optim import large_batch_factor, sgd_with_steps

    factors = [large_batch_factor(s, 10, 8.0, 2, [5], 0.1) for s in (0, 5, 10, 19, 20, 49, 50, 70)]
    assert factors == pytest.approx([1.0, 1.0 + 7 * 5 / 20, 1.0 + 7 * 10 / 20, 1.0 + 7 * 19 / 20, 8.0, 8.0, 0.8, 0.8])
    config = sgd_with_steps(
        [torch.nn.Parameter(torch.zeros(1))], 0.1, milestones=[5], global_batch=256, reference_batch=32,
        warmup_epochs=2, steps_per_epoch=10,
    )  # fmt: skip
    assert config["lr_scheduler"]["interval"] == "step"
    optimizer, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(51):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[0] == pytest.approx(0.1) and rates[20] == pytest.approx(0.8) and rates[50] == pytest.approx(0.08)
    with pytest.raises(ValueError, match="needs `steps_per_epoch`"):
        sgd_with_steps([torch.nn.Parameter(torch.zeros(1))], 0.1, global_batch=64)


def test_batch_geometry_comes_from_the_trainer():
    from types import SimpleNamespace

    from lightning_gravac.zoo.optim import trainer_batch_geometry

    trainer = SimpleNamespace(datamodule=SimpleNamespace(batch_size=32), world_size=4, accumulate_grad_batches=2,
                              max_epochs=10, estimated_stepping_batches=1000)  # fmt: skip
    assert trainer_batch_geometry(SimpleNamespace(trainer=trainer)) == (256, 100)


def test_cifar_download_checks_the_md5_and_extracts(tmp_path, monkeypatch):
    # The real download path, from a file:// URL: an archive of the real layout, its MD5, extraction.
    import hashlib
    import tarfile

    from lightning_gravac.zoo import cifar

    source = tmp_path / "source"
    _write_cifar(source, "cifar10")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    digest = hashlib.md5(archive.read_bytes()).hexdigest()
    real = cifar.ARCHIVES["cifar10"]
    monkeypatch.setitem(
        cifar.ARCHIVES, "cifar10", real.__class__(**{**vars(real), "url": archive.as_uri(), "md5": digest})
    )
    data = CIFARDataModule("cifar10", root=str(tmp_path / "data"), download=True, batch_size=2)
    data.prepare_data()
    data.setup("fit")
    assert len(data.train_set) == 20
    bad = real.__class__(**{**vars(real), "url": archive.as_uri(), "md5": "0" * 32})
    monkeypatch.setitem(cifar.ARCHIVES, "cifar10", bad)
    with pytest.raises(OSError, match=r"MD5 [0-9a-f]{32}, expected 0{32}"):
        cifar.download(tmp_path / "elsewhere", "cifar10")
    # No network (here: nothing at the address): an error that says how to do without, and no partial archive left.
    gone = real.__class__(**{**vars(real), "url": (tmp_path / "nowhere.tar.gz").as_uri()})
    monkeypatch.setitem(cifar.ARCHIVES, "cifar10", gone)
    with pytest.raises(ConnectionError, match=r"could not download .* data\.init_args\.synthetic=true"):
        cifar.download(tmp_path / "offline", "cifar10")
    assert not list((tmp_path / "offline").iterdir())


def test_read_table_one_hots_categories_standardizes_numbers_and_indexes_classes(tmp_path):
    import tarfile

    from lightning_gravac.zoo import read_table

    text = (
        '"","carat","cut","color","price"\n"1",0.5,"Ideal","E",300\n"2",1.5,"Good","J",900\n"3",1.0,"Ideal","E",600\n'
    )
    plain = tmp_path / "small.csv"
    plain.write_text(text)
    x, y, classes = read_table(plain, target="cut", categorical=["color"])
    assert classes == ["Good", "Ideal"] and y.tolist() == [1, 0, 1]
    # carat standardized (-1, 1, 0), color one-hot (E, J), price standardized; the unnamed index column left out
    assert x.shape == (3, 4)
    assert torch.allclose(x[:, 0], torch.tensor([-1.0, 1.0, 0.0])) and x[:, 1:3].tolist() == [[1, 0], [0, 1], [1, 0]]
    assert torch.allclose(x[:, 3], torch.tensor([-1.0, 1.0, 0.0]))
    archive = tmp_path / "tables.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(plain, arcname="csv/small.csv")
    packed = read_table(archive, target="cut", categorical=["color"], member="csv/small.csv")
    assert torch.equal(packed[0], x) and torch.equal(packed[1], y)
    with pytest.raises(FileNotFoundError, match="No table at"):
        read_table(tmp_path / "absent.csv", target="cut")
    with pytest.raises(ValueError, match=r"\['grade'\] are not in"):
        read_table(plain, target="grade")


def test_text_windows_read_a_files_bytes_and_hold_out_its_last_tenth(tmp_path):
    from lightning_gravac.zoo.gpt import ByteGPT, TextDataModule

    text = ("the quick brown fox jumps over the lazy dog. " * 200).encode()
    path = tmp_path / "text.txt"
    path.write_bytes(text)
    data = TextDataModule(str(path), context=16, batch_size=4, steps=3)
    data.setup("fit")
    inputs, targets = next(iter(data.train_dataloader()))
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # the next byte is the target
    window = bytes(inputs[0].tolist())
    assert window in text[: int(len(text) * 0.9)]  # training windows come from the first nine tenths
    held_inputs, _ = next(iter(data.val_dataloader()))
    assert bytes(held_inputs[0].tolist()) in text[int(len(text) * 0.9) :]
    assert torch.equal(held_inputs, next(iter(data.val_dataloader()))[0])  # the same held-out windows every time
    model = ByteGPT(width=32, layers=1, heads=2, context=16)
    assert model(inputs).shape == (4, 16, 256)
    assert 3.2e6 < sum(p.numel() for p in ByteGPT().parameters()) < 3.4e6  # the default size


def test_text_without_a_file_names_it_and_synthetic_mode_needs_none(tmp_path):
    from lightning_gravac.zoo.gpt import TextDataModule

    with pytest.raises(FileNotFoundError, match="synthetic: true"):
        TextDataModule(str(tmp_path / "missing.txt")).setup("fit")
    data = TextDataModule(synthetic=True, synthetic_bytes=5000, context=8, batch_size=2)
    data.setup("fit")
    assert data.data is not None and data.data.numel() == 5000 and int(data.data.max()) < 128
