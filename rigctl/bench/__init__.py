"""Speed measurements: llama-bench matrices (:mod:`.matrix`), server speed and memory (:mod:`.server`),
load curves (:mod:`.load`), drafter races (:mod:`.drafting`) and the memory-bandwidth bound on decode
(:mod:`.bandwidth`)."""
