"""Cluster resolvers, as ``tf.distribute.cluster_resolver``: the tasks of a multi-worker job,
and `join`, which joins this process to it."""

from jstrategy._src.cluster.join import Cluster
from jstrategy._src.cluster.join import join
from jstrategy._src.cluster.layout import ProcessLayout
from jstrategy._src.cluster.layout import training_process_layout
from jstrategy._src.cluster.resolver import ClusterResolver
from jstrategy._src.cluster.simple import SimpleClusterResolver
from jstrategy._src.cluster.slurm import SlurmClusterResolver
from jstrategy._src.cluster.spec import ClusterSpec
from jstrategy._src.cluster.tf_config import TFConfigClusterResolver
from jstrategy._src.strategies.tpu import TPUClusterResolver

__all__ = [
    "Cluster",
    "ClusterResolver",
    "ClusterSpec",
    "ProcessLayout",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "join",
    "training_process_layout",
]
