"""The offline checkpoint converter (a tool beside the layers: it reads the backends' files, nothing of Ray or the
trainer): ``python -m scaletrain.model_merger merge --backend {fsdp,deepspeed,megatron,auto} --local_dir
<run>/global_step_N/actor --target_dir DIR`` turns any saved step of a run into a Hugging Face model directory, in
one process with no GPU, verl's command shape. merge.py does the work; __main__.py is the command line."""

from scaletrain.model_merger.merge import compare, merge

__all__ = ["compare", "merge"]
