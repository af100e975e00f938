"""gear's specs as TensorFlow's: tf.TensorSpec leaves for signatures, where the program uses TensorFlow.

Reverb hands signatures back as ``tf.TensorSpec`` nests; gear does the same
once TensorFlow is imported (gear_client.table_info), and Reverb's tf.data
datasets (gear_client.tf.datasets) take their element specs from here.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from gear_contract import nest, specs

__all__ = ["to_tf_spec", "to_tf_signature"]


def to_tf_spec(spec: Any) -> tf.TensorSpec:
    """A tf.TensorSpec from any spec gear takes (gear's TensorSpec, tf.TensorSpec, a dtype...)."""
    return specs.as_tf_spec(spec, tf)


def to_tf_signature(signature: Any) -> Any:
    """The same nest with every leaf a tf.TensorSpec."""
    return nest.map_structure(to_tf_spec, signature)
