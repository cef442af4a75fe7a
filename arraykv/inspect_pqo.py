"""``python -m arraykv inspect``: one vector through every stage of a PolarQuant (pqo) cache.

For learners. Stages, printed with the first coordinates of each:

1. the input vector ``x`` (a real key of SmolLM2-135M, or a synthetic one with ``--synthetic``);
2. the unit direction ``x / ‖x‖`` and its random rotation ``y = M x / ‖x‖``
   (:func:`arraykv.quant.rotation.rotate`): every coordinate now follows the same
   near-Gaussian density ``∝ (1 − y²)^((d−3)/2)``;
3. the Lloyd-Max codebook of that density (:func:`arraykv.quant.codebooks.make_codebook`)
   and the index of the nearest centroid of each coordinate;
4. the packed bytes and the float16 length (:func:`arraykv.quant.polar.polar_encode`);
5. the reconstruction ``x̂ = n · Mᵀ c[codes]`` (:func:`arraykv.quant.polar.polar_decode`)
   and its error.

With matplotlib (``pip install "arraykv[plot]"``) it saves three figures: the codebook over the
histogram of rotated coordinates, distortion against bits beside the ``4^-b`` lower bound and
the Lloyd-Max optimum, and the per-layer K/V error of a pqo cache on the real model.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._types import Array
from .cli_args import code_bits, nonnegative_int

if TYPE_CHECKING:
    from .integrations.decoder.model import DecoderModel

__all__ = ["add_parser", "check", "run", "stages", "distortion_curve", "layer_errors"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect",
        help="follow one vector through a PolarQuant cache and save plots",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--bits", type=code_bits, default=3, help="bits per coordinate (1-4), default 3")
    p.add_argument(
        "--layer",
        type=nonnegative_int,
        default=None,
        help="layer of the real key vector, default 5 (not with --synthetic)",
    )
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="use a random vector with two outlier channels instead of loading the model",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a known model (default: SmolLM2-135M-Instruct; not with --synthetic)",
    )
    p.add_argument("--out", default=None, help="folder for the plots (default ./arraykv-inspect; not with --no-plots)")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(run=run)


def stages(x: Array, bits: int, *, seed: int = 0) -> dict[str, Any]:
    """Every intermediate of TurboQuant-MSE on vector ``x``.

    Parameters
    ----------
    x : numpy.ndarray, shape (d,), float32
    bits : int
    seed : int, default 0
        Rotation seed.

    Returns
    -------
    dict
        ``unit`` (d,), ``rotated`` (d,), ``codebook`` (Codebook), ``indices`` (d,) int,
        ``code`` (PolarCode: ``codes`` uint8 packed, ``norms`` float16), ``reconstruction`` (d,),
        ``rel_error`` (float: ‖x − x̂‖² / ‖x‖²).
    """

    from .quant.codebooks import make_codebook
    from .quant.polar import polar_decode, polar_encode
    from .quant.rotation import make_rotation, rotate

    x = np.asarray(x, dtype=np.float32)
    d = int(x.shape[-1])
    rot = make_rotation(d, seed, like=x)
    cb = make_codebook(bits, d, like=x)
    unit = x / float(np.linalg.norm(x))
    y = np.asarray(rotate(unit[None, :], rot))[0]
    idx = np.searchsorted(np.asarray(cb.thresholds), y)
    code = polar_encode(x[None, :], cb, rot)
    rec = np.asarray(polar_decode(code, cb, rot, dtype=np.float32))[0]
    return {
        "unit": unit,
        "rotated": y,
        "codebook": cb,
        "indices": idx,
        "code": code,
        "reconstruction": rec,
        "rel_error": float(np.sum((x - rec) ** 2) / np.sum(x * x)),
    }


def distortion_curve(dim: int = 64, n: int = 4000, *, seed: int = 0) -> list[tuple[int, float, float, float]]:
    """Measured TurboQuant-MSE distortion ``E‖u − û‖²`` of random unit vectors, bits 1-4.

    Returns
    -------
    list of (bits, measured, lloyd_max_optimum, lower_bound_4^-b)
    """

    from .quant.codebooks import make_codebook
    from .quant.polar import polar_decode, polar_encode
    from .quant.rotation import make_rotation

    rng = np.random.default_rng(seed)
    u = rng.standard_normal((n, dim)).astype(np.float32)
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    rot = make_rotation(dim, seed, like=u)
    out: list[tuple[int, float, float, float]] = []
    for b in range(1, 5):
        cb = make_codebook(b, dim, like=u)
        rec = np.asarray(polar_decode(polar_encode(u, cb, rot), cb, rot, dtype=np.float32))
        out.append((b, float(np.mean(np.sum((u - rec) ** 2, axis=1))), float(cb.mse), 4.0**-b))
    return out


def layer_errors(model: DecoderModel, method: str, token_ids: list[int]) -> list[tuple[int, float, float]]:
    """Relative K and V error per layer of a cache after prefilling ``token_ids``.

    Returns
    -------
    list of (layer, key_error, value_error)
        ``‖K̂ − K‖² / ‖K‖²`` over every stored token and head, from ``cache.dequantize``.
    """

    from ._compat import to_numpy

    dense, cache = model.make_cache("dense"), model.make_cache(method)
    model.prefill(token_ids, dense)
    model.prefill(token_ids, cache)
    rows: list[tuple[int, float, float]] = []
    for layer in range(model.config.num_layers):
        a, b = dense.dequantize(layer), cache.dequantize(layer)
        ek = float(np.sum((to_numpy(b.k) - to_numpy(a.k)) ** 2) / np.sum(to_numpy(a.k) ** 2))
        ev = float(np.sum((to_numpy(b.v) - to_numpy(a.v)) ** 2) / np.sum(to_numpy(a.v) ** 2))
        rows.append((layer, ek, ev))
    return rows


def _fmt(a: Array, n: int = 8) -> str:
    return "[" + ", ".join(f"{float(v):+.3f}" for v in a[:n]) + ", ...]"


def check(args: argparse.Namespace) -> Any:
    """Check every argument of ``inspect`` before the model loads; fill in the defaults.

    ``--layer`` and ``--model`` do not apply with ``--synthetic``, nor ``--out`` with
    ``--no-plots``; ``--out`` must be a folder that can be made; ``--layer`` is checked against
    the model's layer count, read from its header (:func:`~arraykv.cli_model.model_header`).

    Returns
    -------
    ModelHeader or None
        The model's header (None with ``--synthetic``).

    Raises
    ------
    UsageError
        An argument that cannot work, naming it.
    """
    from .cli_checks import UsageError, check_output_folder, refuse_with

    if args.synthetic:
        refuse_with({"--layer": args.layer, "--model": args.model}, "--synthetic")
    if args.no_plots:
        refuse_with({"--out": args.out}, "--no-plots")
    else:
        args.out = "arraykv-inspect" if args.out is None else args.out
        check_output_folder("--out", args.out)
    if args.synthetic:
        return None
    from .cli_model import model_header

    args.layer = 5 if args.layer is None else args.layer
    header = model_header(args.model)
    if args.layer >= header.num_layers:
        raise UsageError(f"--layer: must be below the model's {header.num_layers} layers, received {args.layer}")
    if header.tokenizer is None:
        raise UsageError(f"--model: {header.path} has no tokenizer; inspect encodes its built-in text")
    if header.context_length < 256:
        raise UsageError(f"--model: inspect runs 256 tokens; the model's context length is {header.context_length}")
    return header


def run(args: argparse.Namespace) -> int:
    header = check(args)
    bits = int(args.bits)
    model = None
    if header is None:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(64).astype(np.float32)
        x[[3, 40]] *= 12.0  # two outlier channels, as real keys have
        source = "synthetic Gaussian vector, channels 3 and 40 scaled x12"
        keys = None
    else:
        from . import eval as ev
        from .cli_model import load_model_of

        model = load_model_of(header)
        ids = ev.builtin_token_ids(model, 128)
        cache = model.make_cache("dense")
        model.prefill(ids, cache)
        keys = np.asarray(cache.dequantize(args.layer).k)[0]  # (kv_heads, tokens, head_dim)
        x = keys[0, 100].astype(np.float32)
        source = f"SmolLM2 key, layer {args.layer}, KV head 0, token 100 of the built-in text"
    s = stages(x, bits)
    cb, code = s["codebook"], s["code"]
    d = x.shape[0]
    print(f"TurboQuant-MSE at {bits} bits on one {d}-dim vector ({source})\n")
    print(f"1. input x                     {_fmt(x)}   |x| = {np.linalg.norm(x):.3f}")
    print(f"2. unit direction x/|x|        {_fmt(s['unit'])}")
    print(
        f"   rotated y = M x/|x|         {_fmt(s['rotated'])}   (randomized Hadamard; max |y| = "
        f"{np.abs(s['rotated']).max():.3f}, vs max |x/|x|| = {np.abs(s['unit']).max():.3f})"
    )
    print(f"3. Lloyd-Max codebook, {2**bits} levels for density (1-y^2)^((d-3)/2):")
    print(f"   centroids                   {_fmt(np.asarray(cb.centroids), 16)}")
    print(f"   indices of y                {list(map(int, s['indices'][:16]))} ...")
    packed = np.asarray(code.codes).reshape(-1)
    print(f"4. packed codes                {packed.size} bytes: {packed[:12].tobytes().hex(' ')} ...")
    print(f"   stored length (float16)     {float(np.asarray(code.norms).reshape(-1)[0]):.4f}")
    print(
        f"   total                       {packed.size + 2} bytes vs {2 * d} in float16 "
        f"({(packed.size + 2) * 8 / d:.2f} bits/value)"
    )
    print(f"5. reconstruction x^           {_fmt(s['reconstruction'])}")
    print(
        f"   relative error |x-x^|^2/|x|^2 = {s['rel_error']:.4f}   (codebook optimum for a unit vector: {cb.mse:.4f})"
    )
    print(
        "\n   Note: before this step the pqo caches center K/V per channel, weight key channels by"
        " sqrt(rms_q/rms_k)\n   and keep outlier key channels exactly; the first tokens and the most"
        " recent ones stay float16\n   (docs/algorithms.md)."
    )

    curve = distortion_curve(d)
    print(f"\nDistortion E|u-u^|^2 of random unit vectors (d={d}):")
    print("   bits   measured   Lloyd-Max optimum   lower bound 4^-b")
    for b, meas, opt, lb in curve:
        print(f"   {b:>4}   {meas:8.5f}   {opt:17.5f}   {lb:16.5f}")
    per_layer = None
    method = f"pqo{bits}"
    if model is not None:
        from . import eval as ev
        from .caches import available_methods

        if method in available_methods():
            per_layer = layer_errors(model, method, ev.builtin_token_ids(model, 256))
            worst = max(per_layer, key=lambda r: r[1])
            print(
                f"\n{method} cache on 256 tokens: mean K error {np.mean([r[1] for r in per_layer]):.4f}, "
                f"V error {np.mean([r[2] for r in per_layer]):.4f}; worst K layer {worst[0]} ({worst[1]:.4f})"
            )
    if not args.no_plots:
        _plots(Path(args.out), s, keys, curve, per_layer, bits, method)
    return 0


def _plots(
    out: Path,
    s: dict[str, Any],
    keys: Array | None,
    curve: list[tuple[int, float, float, float]],
    per_layer: list[tuple[int, float, float]] | None,
    bits: int,
    method: str,
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('\n(plots skipped: matplotlib is not installed; pip install "arraykv[plot]")')
        return

    from .quant.rotation import make_rotation, rotate

    out.mkdir(parents=True, exist_ok=True)
    cb = s["codebook"]
    d = s["unit"].shape[0]
    if keys is not None:
        flat = keys.reshape(-1, d).astype(np.float32)
    else:
        flat = np.random.default_rng(1).standard_normal((2000, d)).astype(np.float32)
    flat = flat / np.linalg.norm(flat, axis=1, keepdims=True)
    y = np.asarray(rotate(flat, make_rotation(d, 0, like=flat))).reshape(-1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(y, bins=120, density=True, alpha=0.5, label="rotated coordinates")
    grid = np.linspace(-4 / math.sqrt(d), 4 / math.sqrt(d), 400)
    dens = (1 - grid**2) ** ((d - 3) / 2)
    ax.plot(grid, dens / (dens.sum() * (grid[1] - grid[0])), label="(1-y²)^((d-3)/2)")
    for c in np.asarray(cb.centroids):
        ax.axvline(float(c), color="k", lw=0.8)
    for t in np.asarray(cb.thresholds):
        ax.axvline(float(t), color="r", lw=0.5, ls=":")
    ax.set_title(f"{bits}-bit Lloyd-Max codebook (black) and thresholds (red) over rotated coordinates")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "codebook.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    b = [r[0] for r in curve]
    ax.semilogy(b, [r[1] for r in curve], "o-", label="measured (polar_encode/decode)")
    ax.semilogy(b, [r[2] for r in curve], "s--", label="Lloyd-Max optimum")
    ax.semilogy(b, [r[3] for r in curve], "k:", label="lower bound 4^-b")
    ax.set_xlabel("bits per coordinate")
    ax.set_ylabel("E|u - u^|^2 (unit vectors)")
    ax.set_xticks(b)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "distortion.png", dpi=120)
    plt.close(fig)
    saved = ["codebook.png", "distortion.png"]
    if per_layer:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r[0] for r in per_layer], [r[1] for r in per_layer], "o-", label="keys")
        ax.plot([r[0] for r in per_layer], [r[2] for r in per_layer], "s-", label="values")
        ax.set_xlabel("layer")
        ax.set_ylabel("|K^ - K|² / |K|²")
        ax.set_title(f"{method} on SmolLM2-135M, 256 tokens")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "layer_error.png", dpi=120)
        plt.close(fig)
        saved.append("layer_error.png")
    print(f"\nplots saved in {out}/: {', '.join(saved)}")
