"""The one error family: what a user can fix (a setting, a file, a checkpoint, a busy directory).

Every error stencil raises for a cause outside the code derives from `StencilError`, so a command
catches that one class and prints `error: <message>` instead of a traceback; anything else is a bug
and keeps its traceback. The subclasses live with the code that raises them:

    shared.config.ConfigError          a setting that cannot work (the message names the field)
    shared.optim.OptimError            a bad optimizer setting (a ConfigError)
    shared.storage.tokenstore.DataError        bad data input: the message names the file and the cause
    shared.storage.checkpoint.CheckpointError  a checkpoint that is missing, damaged, or cannot be written
    shared.runtime.guard.RunLockError          the run directory is in use by another run
    shared.run.TrainingError           the run cannot go on (a non-finite loss, a refused resume)
    shared.modelio.hf.HFError                  a Hugging Face model that does not map onto a variant
    shared.decode.GenerateError        generation that cannot run as asked (a prompt, the batch, a checkpoint)
    shared.runtime.distributed.DistributedError  a multi-process launch that is set up wrongly
    shared.kernels.KernelError         a kernel backend named explicitly that cannot run a call

Each also derives from the builtin it was before (ValueError or RuntimeError), so existing
`except ValueError` code keeps working.
"""


class StencilError(Exception):
    """A cause the user can fix; the message says what and where."""
