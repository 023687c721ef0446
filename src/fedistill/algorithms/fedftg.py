"""FedFTG (Zhang et al., CVPR 2022): data-free fine-tuning of the global model on the server. Card: spec/fedftg.md.

Clients train exactly as in the base method and add their label histogram ``n_k`` (M integers) to the reply.
After aggregation the server refines the new global model (the student) before it is broadcast: a
conditional generator (``cgenerator``, kept across rounds in ``server.state``) is trained to produce inputs on
which the student and the round's client models (the teachers) disagree, while staying recognisable to the
teachers and diverse; the student is then distilled toward the class-weighted teacher ensemble on those
inputs (card §4, ``ServerFineTune``).

It is an ingredient: ``algorithm.name: fedftg`` is FedAvg + FTG, and ``algorithm.plus: {fedftg: {...}}`` adds
it to any parameter-averaging method (SCAFFOLD, FedProx, FedDyn, MOON, FedLMD, FedNova, FedAvgM...). The
fine-tune runs in :meth:`refine`, after the server optimiser and before the base method's server-state update,
so e.g. SCAFFOLD's control variate refers to the model actually broadcast (card ambiguity 13).

Randomness: the round's labels and noise come from ``make_generator(seed, FEDFTG, round)`` and the generator's
initial weights from ``derive_seed(seed, FEDFTG, 0)``, so a resumed run equals an uninterrupted one. Optimisers
are created fresh every round (card ambiguity 14); only the generator's weights persist, as a flat tensor.

``level: feature`` is FedFTG(F) of the paper's Table 5 (card ambiguity 16): the generator is FedGen's
feature generator (noise and label to penultimate features, ``feature_hidden_dim`` wide), teachers and student
are evaluated on those features through their last layer only (:class:`HeadOnly`), and only the global
model's last layer is fine-tuned; the extractor stays as aggregated.

Speed: the teachers are never materialised as modules. One template module (a copy of the global model,
made once) evaluates any teacher with ``torch.func.functional_call`` on views of the uploaded flat vectors,
and the ensemble target ``p̄`` is one batched (vmapped) pass over all teachers. Teachers run under ``no_grad``
except where a gradient must flow through them to the generator (``L_cls``, or ``md_metric_gen="kl"``).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn
from torch.func import functional_call, vmap

from ..engine.seeding import FEDFTG, make_generator
from ..losses import (
    class_ensemble_weights,
    diversity_loss,
    ensemble_distribution,
    generator_objective,
    model_discrepancy,
    soft_cross_entropy,
    stratified_labels,
    weighted_classification_loss,
)
from ..models.flat import float_state
from ..models.generators import FeatureGenerator, build_generator
from ..registry import ALGORITHMS
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import LocalResult, autocast_context, fused
from .server_modules import PersistentModule, label_counts

GENERATOR_KEY = "fedftg_generator"  # server.state: the generator's flat weights (BN statistics included)


class FedFTGParams(FedAvgParams):
    # Card ambiguity 11 (revised 2026-11-24): the |D_k|-weighted mean of the released code, not the paper's plain
    # mean over S_t (the two agree on its balanced partitions). On unbalanced Dirichlet partitions the plain mean lets
    # a 12-sample client count as much as a 2,000-sample one. This equals FedAvg's default, so added to another
    # method through ``plus`` FedFTG brings no weighting of its own: the base's default (or the value set) applies.
    weighting: Literal["samples", "uniform"] = Field("samples", description="aggregation weights p_k (card ambiguity 11)")
    iterations: int = Field(10, ge=0, description="I: generator/student rounds of the fine-tune (0 = the base method)")
    generator_steps: int = Field(1, ge=0, description="I_g: passes over the teachers per iteration, one step each")
    student_steps: int = Field(5, ge=0, description="I_d: student SGD steps per iteration on the same pseudo batch")
    batch_size: int = Field(50, ge=1, description="B: pseudo samples per iteration")
    lambda_cls: float = Field(1.0, ge=0.0, description="λ_cls: weight of the teachers' CE on the pseudo labels")
    lambda_dis: float = Field(1.0, ge=0.0, description="λ_dis: weight of the diversity loss")
    noise_dim: int = Field(100, ge=1, description="d: noise size (card: 100 for CIFAR-10, 256 for CIFAR-100)")
    generator_width: int = Field(64, ge=1, description="ngf of the CGeneratorA")
    student_lr: float = Field(0.1, gt=0.0, description="student SGD lr at round 1, times lr_decay^(t-1)")
    generator_lr: float = Field(0.01, gt=0.0, description="generator Adam lr at round 1, times lr_decay^(t-1)")
    lr_decay: float = Field(0.998, gt=0.0, le=1.0, description="per-round decay of both lrs (card ambiguity 10)")
    student_weight_decay: float = Field(1e-3, ge=0.0, description="student SGD weight decay (no momentum)")
    md_metric_gen: Literal["l1_logits", "kl", "mse"] = Field(
        "l1_logits", description="the generator's discrepancy L_md (ambiguity 1; mse is the Table 4 ablation)"
    )
    hard_sample_mining: bool = Field(True, description="False drops −L_md from the generator loss (Table 4)")
    label_sampling: Literal["customized", "uniform"] = Field("customized", description="p_t of Eq. 9, or uniform")
    ensemble: Literal["class", "uniform"] = Field("class", description="α of Eq. 10, or 1/|S_t|")
    cls_weighting: Literal["per_sample", "batch_scalar"] = Field(
        "per_sample", description="α inside L_cls per sample (Eq. 5) or the code's mean(α)·mean(CE) (ambiguity 4)"
    )
    student_reduction: Literal["code", "batchmean"] = Field(
        "code", description="student soft-CE over B·M (code) or over B (ambiguity 3)"
    )
    freeze_student_bn_stats: bool = Field(
        False, description="student BatchNorm in eval mode while distilling: keeps the real-data running stats"
    )
    level: Literal["image", "feature"] = Field(
        "image", description="image: CGeneratorA inputs, whole model tuned; feature: FedFTG(F) (Table 5)"
    )
    feature_hidden_dim: int = Field(256, ge=1, description="level feature: hidden width of the feature generator")


class HeadOnly(nn.Module):
    """A classifier seen from its penultimate features: ``forward(f) = model.classify(f)`` (FedFTG(F)).

    Its state dict is the model's (keys prefixed ``model.``), in the same order, so the uploaded flat vectors
    fit it unchanged and :class:`TeacherEnsemble` evaluates a teacher's head on generated features."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.classify(features)


def _like_template(stacked: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``stacked`` (K teachers' copies of one weight) laid out so that each teacher's slice has the template
    weight's strides: channels-last convolution kernels stay channels-last, as in the run's models
    (run.channels_last), down to the stride of a 1-channel kernel's size-1 dimension, which decides the layout
    of the convolution's output. With contiguous kernel views the teachers' convolutions wrote NCHW
    activations, whose 2x2 max-pooling with gradient (the generator's training goes through the teachers) ran
    4-9x slower than on channels-last ones (bf16, one thread, (50, 16, 28, 28): 2.9 ms against 0.37 ms), 14-20 %
    of FedDF's round. The values are the same; only the strides differ."""
    if template.stride() == stacked[0].stride():
        return stacked
    laid_out = torch.empty_strided(stacked.shape, (template.numel(), *template.stride()), dtype=stacked.dtype, device=stacked.device)
    return laid_out.copy_(stacked)


class TeacherEnsemble:
    """The round's client models as parameter dicts over one reusable template module.

    The template is a deep copy of the global model made once (eval mode, no gradients); a teacher is a set of
    views into the stacked uploaded vectors, evaluated with ``functional_call``: no module per teacher, no
    weight copy per step, and the uploads themselves are never written (card §7: teachers unchanged).
    """

    def __init__(self) -> None:
        self._template: nn.Module | None = None
        self._names: list[str] = []
        self._shapes: list[torch.Size] = []
        self.members: list[dict[str, torch.Tensor]] = []
        self.stacked: dict[str, torch.Tensor] = {}
        self._batched_ok: bool | None = None

    def load(self, model: nn.Module, vectors: list[torch.Tensor], device: torch.device) -> "TeacherEnsemble":
        template = self._template
        if template is None or sum(s.numel() for s in self._shapes) != vectors[0].numel():
            template = copy.deepcopy(model).to(device).requires_grad_(False).eval()
            state = template.state_dict(keep_vars=True)
            self._names = [name for name, t in state.items() if t.is_floating_point()]
            self._shapes = [t.shape for t in float_state(template)]
            self._template, self._batched_ok = template, None
        stacked = torch.stack([v.float() for v in vectors]).to(device)  # (K, P): a copy, the replies stay as sent
        self.stacked, offset = {}, 0
        state = template.state_dict(keep_vars=True)
        for name, shape in zip(self._names, self._shapes):
            n = shape.numel()
            view = stacked[:, offset : offset + n].view(len(vectors), *shape)
            self.stacked[name] = _like_template(view, state[name])
            offset += n
        self.members = [{name: t[k] for name, t in self.stacked.items()} for k in range(len(vectors))]
        return self

    def __len__(self) -> int:
        return len(self.members)

    def logits(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Teacher k's logits (eval mode); differentiable in ``x`` when called with grad enabled."""
        assert self._template is not None
        return functional_call(self._template, self.members[k], (x,))

    def all_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(K, B, M) logits of every teacher on the same batch.

        One vmapped pass for convolution-free models (an MLP: the linear layers become batched matmuls, about
        2x faster than a loop at batch 50); a loop over the teachers otherwise, because vmap turns a convolution
        with per-teacher weights into a grouped convolution that oneDNN runs 4-6x slower than K plain ones
        (8 FedNTD CNN teachers, bf16, 2 threads: 2.29 s vs 0.40 s for 512 samples, 215 vs 50 ms for 50;
        ResNet-8 2.75 s vs 0.93 s; RESULTS.md, issue 15 target 2).
        """
        assert self._template is not None
        template = self._template
        if self._batched_ok is None and any(isinstance(m, nn.modules.conv._ConvNd) for m in template.modules()):
            self._batched_ok = False
        if self._batched_ok is not False:
            try:
                out = vmap(lambda params: functional_call(template, params, (x,)))(self.stacked)
                self._batched_ok = True
                return out
            except Exception:  # an op without a batching rule: the loop gives the same values
                if self._batched_ok:
                    raise
                self._batched_ok = False
        return torch.stack([self.logits(k, x) for k in range(len(self))])


@ALGORITHMS.register("fedftg")
class FedFTG(FedAvg):
    """FedFTG: the base method's aggregate, fine-tuned on the server by hard-sample data-free distillation."""

    name = "fedftg"
    Params = FedFTGParams
    # its generator makes square images; the synthetic dataset's 60-dim feature vectors have no such shape
    cannot_run = {"synthetic": "its generator makes images, and synthetic has feature vectors"}

    def __init__(self, params: FedFTGParams, local: Any) -> None:
        super().__init__(params, local)
        self._generator = PersistentModule(GENERATOR_KEY, FEDFTG, self._build_generator)
        self._teachers = TeacherEnsemble()

    def _build_generator(self, server: ServerContext) -> nn.Module:
        if self.params.level == "feature":  # FedFTG(F): FedGen's generator shape (card ambiguity 16)
            return FeatureGenerator(
                self.params.noise_dim, server.num_classes, server.model.feature_dim, self.params.feature_hidden_dim
            )
        return build_generator(
            "cgenerator", server.input_shape, server.num_classes,
            noise_dim=self.params.noise_dim, ngf=self.params.generator_width,
        )  # fmt: skip

    # -- client ---------------------------------------------------------------------------------
    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        # n_k: M integers per round (the card's "every round" case; counted in the upload bytes).
        return {"label_counts": label_counts(client)}

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        if len(server.input_shape) == 3:  # else made on first use (a bare ServerContext in a test)
            self._generator.init_state(server)

    def refine(self, server: ServerContext, info: RoundInfo, replies: list[Message], cids: list[int]) -> dict[str, float]:
        p = self.params
        if p.iterations == 0:
            return {}  # the base method's round, bit for bit; the generator is not touched
        started = time.perf_counter()
        counts = torch.stack([r["label_counts"].to(torch.int64) for r in replies])  # (K, M)
        generator = self._generator.load(server)
        student: nn.Module = server.model
        tuned = None
        if p.level == "feature":  # FedFTG(F): features in, only the last layer of the global model tuned
            if getattr(self, "_head", None) is None or self._head.model is not server.model:
                self._head = HeadOnly(server.model)
            student, tuned = self._head, list(server.model.classifier.parameters())
        teachers = self._teachers.load(student, [r["weights"] for r in replies], server.device)
        metrics = server_fine_tune(
            student, generator, teachers, counts, p,
            rng=make_generator(server.seed, FEDFTG, info.round),
            lr_scale=p.lr_decay ** (info.round - 1),
            precision=server.precision,
            student_params=tuned,
        )  # fmt: skip
        self._generator.store(server, generator)
        teachers.members, teachers.stacked = [], {}  # free the round's stacked uploads
        return {**metrics, "fedftg_refine_seconds": time.perf_counter() - started}


def server_fine_tune(
    student: nn.Module,
    generator: nn.Module,
    teachers: TeacherEnsemble,
    label_counts: torch.Tensor,
    p: FedFTGParams,
    rng: torch.Generator,
    lr_scale: float = 1.0,
    precision: str = "fp32",
    student_params: list[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Card §4 ``ServerFineTune``: I iterations of (I_g generator passes, I_d student steps), in place.

    ``label_counts`` is the (K, M) matrix of the teachers' ``n_k`` in teacher order. Returns the mean generator
    discrepancy L_md and the mean student loss L_S over the steps taken (absent when no such step ran).
    ``student_params`` restricts the student's SGD to these tensors (FedFTG(F): the last layer); default all.
    """
    device = next(student.parameters()).device
    num_teachers, num_classes = label_counts.shape
    # α^{k,y} (Eq. 10 or uniform) and the pooled counts that p_t follows (Eq. 9 or uniform).
    if p.ensemble == "class":
        alpha_table = class_ensemble_weights(label_counts)
    else:
        alpha_table = torch.full((num_teachers, num_classes), 1.0 / num_teachers)
    pooled = label_counts.sum(dim=0) if p.label_sampling == "customized" else torch.ones(num_classes, dtype=torch.int64)
    labels = stratified_labels(p.iterations * p.batch_size, pooled, rng)
    alpha_table = alpha_table.to(device)

    if student_params is None:
        student_params = [q for q in student.parameters() if q.requires_grad]
    generator_params = [q for q in generator.parameters() if q.requires_grad]
    # Fresh optimisers every round (card ambiguity 14): plain SGD for ω, Adam for θ.
    opt_student = torch.optim.SGD(
        student_params, lr=p.student_lr * lr_scale, weight_decay=p.student_weight_decay, **fused(device)
    )
    opt_generator = torch.optim.Adam(generator_params, lr=p.generator_lr * lr_scale, betas=(0.9, 0.999), **fused(device))
    # A gradient must flow through a teacher only for L_cls and for the KL discrepancy.
    teacher_grad = p.lambda_cls > 0 or p.md_metric_gen == "kl"
    student_was_training = student.training
    md_sum = torch.zeros((), device=device)
    ls_sum = torch.zeros((), device=device)
    md_count = ls_count = 0

    def autocast():
        return autocast_context(precision, device)

    for i in range(p.iterations):
        y = labels[i * p.batch_size : (i + 1) * p.batch_size].to(device)
        z = torch.randn(p.batch_size, p.noise_dim, generator=rng).to(device)
        alpha = alpha_table[:, y].T  # (B, K): α^{k, y_b}

        # Generator phase: student frozen in eval mode; one Adam step per teacher, fresh forward each time.
        generator.train()
        student.eval()
        for _ in range(p.generator_steps):
            for k in range(num_teachers):
                with autocast():
                    x = generator(z, y)
                    student_logits = student(x)
                    with torch.set_grad_enabled(teacher_grad):
                        teacher_logits = teachers.logits(k, x)
                md = model_discrepancy(student_logits, teacher_logits, alpha[:, k], p.md_metric_gen)
                cls = (
                    weighted_classification_loss(teacher_logits, y, alpha[:, k], p.cls_weighting)
                    if p.lambda_cls > 0 else md.new_zeros(())
                )  # fmt: skip
                dis = diversity_loss(x, z) if p.lambda_dis > 0 else md.new_zeros(())
                loss = generator_objective(
                    md, cls, dis, p.lambda_cls, p.lambda_dis, num_teachers, hard_sample_mining=p.hard_sample_mining
                )
                md_sum += md.detach()
                md_count += 1
                if not loss.requires_grad:
                    continue  # every term switched off: nothing to learn from
                opt_generator.zero_grad(set_to_none=True)
                # Gradients for θ only: the student and the teachers stay frozen (no .grad written to them).
                loss.backward(inputs=generator_params)
                opt_generator.step()

        # Student phase: the generator in eval mode makes one batch, the ensemble target is computed once.
        generator.eval()
        with torch.no_grad(), autocast():
            x = generator(z, y)
            target = ensemble_distribution(teachers.all_logits(x), alpha)
        student.train(not p.freeze_student_bn_stats)
        for _ in range(p.student_steps):
            with autocast():
                student_logits = student(x)
            loss = soft_cross_entropy(student_logits, target, p.student_reduction)
            opt_student.zero_grad(set_to_none=True)
            loss.backward()
            opt_student.step()
            ls_sum += loss.detach()
            ls_count += 1
    student.train(student_was_training)
    metrics = {}
    if md_count:
        metrics["fedftg_md"] = float(md_sum) / md_count
    if ls_count:
        metrics["fedftg_student_loss"] = float(ls_sum) / ls_count
    return metrics
