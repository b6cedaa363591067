"""Training tools: the shipped model's pretraining recipe and LycheeDecode's head gates."""
from .gates import GateState, load_retrieval_heads, train_gates

__all__ = ["GateState", "load_retrieval_heads", "train_gates"]
