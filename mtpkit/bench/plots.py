"""PNG plots of benchmark results (matplotlib's Agg canvas: no display, no global pyplot)."""

from __future__ import annotations

from pathlib import Path

from .common import save_figure


def _figure(w: float = 6.4, h: float = 4.2):
    # A bare Figure draws on the Agg canvas without touching pyplot's global state, so that
    # no GUI backend is ever chosen and repeated calls leak no figures.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h))
    return fig, fig.add_subplot()


def offline_plots(result: dict, out: Path) -> list[Path]:
    """speedup.png, acceptance.png and tokens_per_s.png from an offline results dict."""
    rows = result["per_k"]
    ks = [r["k"] for r in rows]
    title = result.get("title", "")
    paths = []

    fig, ax = _figure()
    ax.plot(ks, [r["speedup"] or 0 for r in rows], "o-", label="measured")
    bounds = [r["bound_tokens_per_s"] for r in rows]
    if all(bounds) and bounds[0]:
        ax.plot(ks, [b / bounds[0] for b in bounds], "s--", alpha=0.6,
                label="bandwidth-bound limit (ratio)")
    ax.axhline(1.0, color="grey", lw=0.8)
    best = result["recommended_k"]
    best_speedup = next(r["speedup"] or 0 for r in rows if r["k"] == best)
    ax.plot([best], [best_speedup], "*", ms=16, color="tab:green", label=f"best: k={best}")
    ax.set(xlabel="draft tokens k", ylabel="speed-up over k=0", xticks=ks,
           title=f"Decode speed-up vs k {title}".strip())
    ax.legend()
    paths.append(out / "speedup.png")
    save_figure(fig, paths[-1])

    fig, ax = _figure()
    for r in rows:
        rates = r["per_position_acceptance_rate"]
        if r["k"] and rates:
            ax.plot(range(1, len(rates) + 1), [100 * x for x in rates], "o-",
                    label=f"k={r['k']} (mean len {r['mean_acceptance_length']:.2f})")
    ax.set(xlabel="draft position", ylabel="acceptance rate (%)", ylim=(0, 100),
           title=f"Per-position acceptance {title}".strip())
    depth = max((len(r["per_position_acceptance_rate"]) for r in rows), default=0)
    ax.set_xticks(range(1, depth + 1))
    if depth:
        ax.legend()
    paths.append(out / "acceptance.png")
    save_figure(fig, paths[-1])

    fig, ax = _figure()
    ax.boxplot([r["run_tokens_per_s"] or [0.0] for r in rows], showmeans=True)
    # (requests of one token have no decode rate and are left out of run_tokens_per_s)
    ax.set_xticks(range(1, len(ks) + 1), [str(k) for k in ks])
    ax.set(xlabel="draft tokens k", ylabel="tokens/s per request",
           title=f"Tokens/s distribution {title}".strip())
    paths.append(out / "tokens_per_s.png")
    save_figure(fig, paths[-1])
    return paths


def compare_plot(rows: list[dict], out: Path) -> Path:
    """compare.png: tokens/s per engine, with each one's bandwidth-bound limit."""
    fig, ax = _figure(8, 4.5)
    names = [r["engine"] for r in rows]
    rates = [r["tokens_per_s"] or 0 for r in rows]
    ys = range(len(rows))
    ax.barh(ys, rates, color="tab:blue", label="measured")
    bounds = [r.get("bound_tokens_per_s") for r in rows]
    bx = [(y, b) for y, b in zip(ys, bounds, strict=True) if b]
    if bx:
        ax.scatter([b for _, b in bx], [y for y, _ in bx], marker="|", s=300, color="tab:red",
                   label="bandwidth-bound limit")
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set(xlabel="decode tokens/s", title="Same prompts, same model, same machine")
    ax.legend(loc="lower right")
    path = out / "compare.png"
    save_figure(fig, path)
    return path
