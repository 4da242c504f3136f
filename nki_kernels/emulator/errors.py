"""Exceptions raised by the emulator.

Every broken hardware rule raises :class:`NkiValidationError`, a ``ValueError`` subclass, with a
message that names the instruction, the operand and the limit. The real ``nki.isa`` package defines
an exception of the same name ("raised when hardware constraints are violated").
"""


class NkiValidationError(ValueError):
    """A kernel asked for something the NeuronCore (or the NKI compiler) would reject."""


class NkiRuntimeError(RuntimeError):
    """A runtime fault the device would raise, e.g. an out-of-bounds indirect DMA with oob_mode.error."""


def fail(instr: str, operand: str, msg: str) -> "NkiValidationError":
    """Build the standard error: ``<instr>: operand '<operand>' <msg>``."""
    if operand:
        return NkiValidationError(f"{instr}: operand '{operand}' {msg}")
    return NkiValidationError(f"{instr}: {msg}")
