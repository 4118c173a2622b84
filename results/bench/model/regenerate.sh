#!/usr/bin/env bash
# Rebuild summary.md and model.png of results/bench/model from the raw inputs here (from the repo root).
# Later inputs replace earlier runs of the same configuration and round; the second device call of
# 2026-12-03 (raw/s3/cp1-round2) holds the patched process of round 2 and a third patched one;
# raw/s4 (2026-12-03, second session) adds all_gather at CP=1/4, headwise at CP=1 and ideal for CP=2 (raw/s4/m-ag2s
# repeats a configuration of s3 as the first of its process, with its one-time warm-up sync: not an input).
set -euo pipefail
R=results/bench/model/raw; S=$R/s3; S4=$R/s4
exec "${PYTHON:-.venv/bin/python}" bench/model_report.py \
  $R/cp1.json $R/cp2.json $R/cp4-8192/base-cp4.json $R/cp4-8192/patched-cp4.json \
  $S/cp1-round1/parts/patched-cp1.json $S/cp1-round1/parts/base-cp1.json $S/cp1-round1/parts/base-cp1-r2.json \
  $S/cp1-round2/parts/patched-cp1.json $S/cp1-round2/parts/patched-cp1-r2.json \
  $S/cp2-cp4/parts/patched-cp2.json $S/cp2-all_gather/parts/patched-cp2.json \
  $S4/m-ag/parts/patched-cp2.json $S4/m-ag4/parts/patched-cp4.json \
  $S4/m-cp1/parts/patched-cp1.json $S4/m-cp1/parts/patched-cp1-r2.json $S4/m-ag1/parts/patched-cp1.json \
  $S4/m-ideal/parts/ideal-p2.json \
  --round-offset $S/cp1-round2/parts/patched-cp1.json=1 --round-offset $S/cp1-round2/parts/patched-cp1-r2.json=1 \
  --lines $R/cp1.log.lines $R/cp2.log.lines $R/cp4.log.lines $R/cp4-8192/lines.txt \
  --outdir results/bench/model
