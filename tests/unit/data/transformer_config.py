"""Minimal stand-in for the configuration module (test data, not upstream code)."""

from dataclasses import dataclass


@dataclass
class TransformerConfig:
    """Toy config."""

    hidden_size: int = 8

    cp_comm_type: str = "p2p"
    """How attention exchanges keys and values across CP ranks."""

    num_layers: int = 2

    def __post_init__(self):
        if self.hidden_size <= 0:
            raise ValueError("hidden_size must be positive")
        tp_cp_size = self.tensor_model_parallel_size * self.context_parallel_size
        assert self.linear_num_key_heads % tp_cp_size == 0
        assert self.linear_num_value_heads % tp_cp_size == 0
        self.done = True
