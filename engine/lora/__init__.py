"""LoRA adapters served over a loaded base: adapters.py reads torchtune's and PEFT's files, checks
them against the base and cuts them per model-parallel rank; layers.py applies them unmerged, per
run of rows of each adapter in a step."""
