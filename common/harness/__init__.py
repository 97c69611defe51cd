"""The guards around a training recipe, written once: preflight, the out_dir lock, the resume record and its
refusal, stop signals and --time_limit, the self-launcher, the dry run and its plan, the pilot report, the
held-out evaluation and the export verifier. The core (common/) never imports this package; an example copied
with the core alone trains and exports without these guards."""

