"""The report's KL divergence section: per KLD step of the campaign, each host's quantised artifacts against the
reference (llama-perplexity's mean KLD, 99th percentile and same-top-1 share, each with its 95% interval over
the text's chunks, :mod:`rigctl.analysis.kld`), then the paired gaps between hosts and between artifacts that
scored the same tokens. Each number links to llama-perplexity's output it was printed in and the per-token
values its interval resampled."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rigctl.analysis.kld import GAP_HEADER, ROW_HEADER, gap_cells, kld_results, paired_gaps, result_cells
from rigctl.analysis.report.markdown import Links, md_table
from rigctl.hostside.kld_task import RAW_DIR

if TYPE_CHECKING:
    from rigctl.analysis.campaign import LoadedCampaign, Located

_INTRO = ("KL divergence of each quantised model's next-token distribution from its reference's, over the "
          "stated text cut into chunks of the stated context, as `llama-perplexity --kl-divergence` computes it "
          "(each token's sum over the reference's vocabulary where its log-probability is above -16). The "
          "numbers are llama-perplexity's own; the 95% intervals resample whole chunks of the per-token values "
          "recomputed from both models' logits (they agree with llama.cpp's to about 1e-4 on the mean, and run "
          "up to half a percent low at the 99th percentile: the quantised side's stored log-probabilities stop "
          "16 nats below its top). Same top-1: both models' most likely token agrees.")


def kld_section(loaded: LoadedCampaign, found: Located, links: Links) -> list[str]:
    campaign = loaded.campaign
    if not campaign.klds:
        return []
    lines = ["## KL divergence", "", _INTRO, ""]
    for step in campaign.klds:
        lines += [f"### {step.name}: {', '.join(campaign.label(m) for m in step.models)} against "
                  f"{campaign.label(step.reference)}", ""]
        rows, scored = [], []
        for host in step.hosts:
            run = found.klds.get((step.name, host))
            if run is None:
                rows.append([host, "-", campaign.label(step.reference), "not pulled yet", "-", "-", "-", "-"])
                continue
            for result in kld_results(run, resamples=campaign.resamples, seed=campaign.seed):
                files = [run.path / RAW_DIR / f"{result.artifact}.txt",
                         run.path / RAW_DIR / f"{result.artifact}.tokens.jsonl"]
                cells = result_cells(result)
                cells[1], cells[2] = campaign.label(result.artifact), campaign.label(result.reference)
                cells[4:7] = [links.number(cell, files) for cell in cells[4:7]]
                rows.append(cells)
                scored.append((run, result))
        if scored:
            first = scored[0][1]
            lines += [f"Text: {first.corpus}, `-c {first.ctx}`.", ""]
        lines += [*md_table(ROW_HEADER, rows, align="lll"), ""]
        gaps = paired_gaps(scored, resamples=campaign.resamples, seed=campaign.seed)
        if gaps:
            lines += ["Paired on the same tokens (B - A):", "",
                      *md_table(GAP_HEADER, [gap_cells(g, campaign.label) for g in gaps], align="l"), ""]
    return lines
