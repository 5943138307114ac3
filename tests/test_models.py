"""The shipped models: parameter counts by hand, shapes, structure, and the normalisation rule
(replicas that apply the same robust aggregate stay bitwise equal, buffers included)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import robustagg as ra
from robustagg.errors import ConfigError, ShapeError
from robustagg.models import (MLP, BasicBlock, LeNet5, ResNet18, ResNet20, SmallCNN, buffer_vector,
                              has_running_stats, load_buffer_vector, make_norm)


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_lenet5_parameter_count_by_hand():
    # C1 6*(5*5*C_in + 1); C3 16*(6*25 + 1) = 2416; C5 120*(400 + 1) = 48120; F6 84*(120 + 1) = 10164;
    # output 10*(84 + 1) = 850.  C_in = 1: 156 + 2416 + 48120 + 10164 + 850 = 61706; C_in = 3: 456 + ... = 62006.
    assert n_params(LeNet5((1, 28, 28), 10)) == 61706
    assert n_params(LeNet5((3, 32, 32), 10)) == 62006


def test_resnet20_parameter_count_by_hand():
    # stem 3*16*9 + 2*16 = 464; stage 1: 6 convs 16*16*9 + 6 norms 2*16 = 14016;
    # stage 2: 32*16*9 + 5*32*32*9 + 6*2*32 = 51072; stage 3: 64*32*9 + 5*64*64*9 + 6*2*64 = 203520;
    # head 64*10 + 10 = 650. Total 464 + 14016 + 51072 + 203520 + 650 = 269722 (option A shortcuts: no params).
    assert n_params(ResNet20()) == 269722
    assert n_params(ResNet20(norm="batch")) == 269722  # BatchNorm and GroupNorm both carry 2C affine params
    assert abs(n_params(ResNet20()) - 0.27e6) / 0.27e6 < 0.01  # He et al. 2016, Table 6: 0.27M


def test_resnet18_parameter_count_by_hand():
    # stem 1728 + 128; stage 1: 4*36864 + 4*128; stage 2: 73728 + 3*147456 + 4*256 + (8192 + 256) projection;
    # stage 3: 294912 + 3*589824 + 4*512 + (32768 + 512); stage 4: 1179648 + 3*2359296 + 4*1024 + (131072 + 1024);
    # head 5130 -> 11,173,962.
    assert n_params(ResNet18()) == 11173962


def test_resnet20_has_20_weighted_layers_and_the_paper_feature_map_sizes():
    m = ResNet20()
    convs = [x for x in m.modules() if isinstance(x, nn.Conv2d)]
    linears = [x for x in m.modules() if isinstance(x, nn.Linear)]
    assert len(convs) + len(linears) == 20 and len(convs) == 19  # 6n + 2 with n = 3
    shapes = []
    hooks = [s.register_forward_hook(lambda mod, i, o: shapes.append(tuple(o.shape[1:]))) for s in m.stages]
    m(torch.zeros(1, 3, 32, 32))
    for h in hooks:
        h.remove()
    assert shapes == [(16, 32, 32), (32, 16, 16), (64, 8, 8)]
    assert not any(isinstance(x, nn.MaxPool2d) for x in ResNet18().modules())  # CIFAR variant: no max-pool
    assert ResNet18().stem[0].kernel_size == (3, 3) and ResNet18().stem[0].stride == (1, 1)


@pytest.mark.parametrize("make,shape", [(lambda c: LeNet5((1, 28, 28), c), (1, 28, 28)),
                                        (lambda c: LeNet5((3, 32, 32), c), (3, 32, 32)),
                                        (lambda c: ResNet20(num_classes=c), (3, 32, 32)),
                                        (lambda c: ResNet18(num_classes=c), (3, 32, 32)),
                                        (lambda c: ResNet20((1, 28, 28), c), (1, 28, 28)),
                                        (lambda c: SmallCNN((3, 32, 32), [8], c), (3, 32, 32)),
                                        (lambda c: MLP(3 * 32 * 32, [16], c), (3, 32, 32))])
def test_output_shapes_for_image_and_flattened_inputs(make, shape):
    m = make(100).eval()
    x = torch.rand(3, *shape)
    out = m(x)
    assert out.shape == (3, 100) and out.dtype == torch.float32
    assert torch.equal(m(x.reshape(3, -1)), out)  # flattened inputs are the same examples


def test_option_a_shortcut_subsamples_and_zero_pads_by_hand():
    blk = BasicBlock(2, 4, 2, shortcut="A", norm="group", num_groups=2)
    for conv in (blk.conv1, blk.conv2):
        nn.init.zeros_(conv.weight)  # the residual branch is 0 (GroupNorm of zeros is its bias, 0)
    x = torch.arange(1.0, 33.0).reshape(1, 2, 4, 4)
    out = blk(x)
    assert out.shape == (1, 4, 2, 2)
    assert out[0, 0].tolist() == [[1.0, 3.0], [9.0, 11.0]]  # x[0, 0, ::2, ::2]
    assert out[0, 1].tolist() == [[17.0, 19.0], [25.0, 27.0]]
    assert out[0, 2:].abs().sum() == 0  # appended channels are zeros


def test_bad_model_arguments_are_clear_errors():
    with pytest.raises(ConfigError, match=r"model=lenet5 needs images of shape \(C, 28, 28\) or \(C, 32, 32\)"):
        LeNet5((1, 8, 8))
    with pytest.raises(ConfigError, match="model.num_groups=3 must divide every layer's channels; 16 does not"):
        ResNet20(num_groups=3)
    with pytest.raises(ConfigError, match="model.norm must be 'group', 'batch' or 'none'; got 'layer'"):
        ResNet20(norm="layer")
    with pytest.raises(ConfigError, match=r"needs image data of shape \(C, H, W\)"):
        ResNet18((784,))


def test_experiments_models_reexports_the_library_classes():
    import experiments.models as em

    assert em.MLP is MLP and em.SmallCNN is SmallCNN
    assert isinstance(em.build_model("cnn", input_shape=(1, 8, 8), num_classes=10), SmallCNN)


# ------------------------------------------------------------------------------------------------
# replicas under one robust aggregate
def _replica_step(models: list[nn.Module], opts: list[torch.optim.Optimizer], batches, rule) -> torch.Tensor:
    """Each replica computes its gradient on its own batch (train mode, as the trainer does); the rule
    aggregates the flattened gradients; every replica applies that same aggregate."""
    grads = []
    for m, (x, y) in zip(models, batches):
        m.train()
        m.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m(x), y).backward()
        grads.append(ra.flatten([p.grad for p in m.parameters()]))
    agg = rule(torch.stack(grads))
    for m, o in zip(models, opts):
        for p, g in zip(m.parameters(), ra.unflatten_like(agg, list(m.parameters()))):
            p.grad = g.clone()
        o.step()
    return agg


def _batches(k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(k)]


def _assert_bitwise_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)


def test_groupnorm_replicas_stay_bitwise_equal_after_a_step_and_after_a_restore():
    torch.manual_seed(0)
    base = ResNet20()
    assert not has_running_stats(base) and len(list(base.buffers())) == 0
    models = [copy.deepcopy(base) for _ in range(3)]
    opts = [_sgd(m) for m in models]
    rule = ra.CoordinateWiseMedian(f=1)
    _replica_step(models, opts, _batches(3, 1), rule)  # three different batches
    assert not torch.equal(models[0].stem[0].weight, base.stem[0].weight)  # the step did move the model
    for m in models[1:]:
        _assert_bitwise_equal(models[0], m)
    # restore: a fresh replica (another init) loads the committed model and optimizer state, then
    # every replica takes the next step from new batches; all stay equal.
    torch.manual_seed(99)
    fresh = ResNet20()
    fresh.load_state_dict(copy.deepcopy(models[0].state_dict()))
    fresh_opt = _sgd(fresh)
    fresh_opt.load_state_dict(copy.deepcopy(opts[0].state_dict()))
    models[2], opts[2] = fresh, fresh_opt
    _replica_step(models, opts, _batches(3, 2), rule)
    for m in models[1:]:
        _assert_bitwise_equal(models[0], m)


def test_batchnorm_buffers_diverge_without_a_buffer_rule_and_agree_with_one():
    torch.manual_seed(0)
    base = ResNet20(norm="batch")
    assert has_running_stats(base)
    models = [copy.deepcopy(base) for _ in range(3)]
    opts = [_sgd(m) for m in models]
    rule = ra.CoordinateWiseMedian(f=1)
    _replica_step(models, opts, _batches(3, 1), rule)
    for m in models[1:]:  # the parameters agree (same aggregate) ...
        assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), m.parameters()))
    bufs = [buffer_vector(m) for m in models]
    assert not torch.equal(bufs[0], bufs[1])  # ... the running statistics do not: the trap
    agreed = rule(torch.stack(bufs))  # a buffer rule: the same robust rule over the buffers
    for m in models:
        load_buffer_vector(m, agreed)
    for m in models[1:]:
        _assert_bitwise_equal(models[0], m)


def test_buffer_vector_roundtrip_and_shape_check():
    m = ResNet20(norm="batch")
    v = buffer_vector(m)
    assert v.numel() == 2 * sum(x.num_features for x in m.modules() if isinstance(x, nn.BatchNorm2d))
    load_buffer_vector(m, torch.arange(v.numel(), dtype=torch.float32))
    assert torch.equal(buffer_vector(m), torch.arange(v.numel(), dtype=torch.float32))
    with pytest.raises(ShapeError, match=rf"buffer vector must have shape \({v.numel()},\)"):
        load_buffer_vector(m, torch.zeros(3))
    assert buffer_vector(ResNet20()).numel() == 0 and isinstance(make_norm("none", 4), nn.Identity)
