"""Configuration: TOML files with command-line overrides, validated in one place."""

from llmgw.config.errors import ConfigError
from llmgw.config.loader import load_config, parse_hostport
from llmgw.config.schema import AgentConfig, ServerConfig

__all__ = ["AgentConfig", "ConfigError", "ServerConfig", "load_config", "parse_hostport"]
