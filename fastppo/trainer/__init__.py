"""The PPO trainer: configuration, tasks and rewards, models, and the training loop."""

from .config import TrainConfig
from .ppo import PPOTrainer

__all__ = ["TrainConfig", "PPOTrainer"]
