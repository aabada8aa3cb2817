"""Deployment configuration: ``DeployConfig`` built from YAML layers and overrides."""

from .deploy_config import DeployConfig, load_deploy_config, parse_dotted_overrides  # noqa: F401
