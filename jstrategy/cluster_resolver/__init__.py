"""Cluster resolvers, as ``tf.distribute.cluster_resolver``: the tasks of a multi-worker job,
and `join`, which joins this process to it."""

from jstrategy._src.cluster import Cluster
from jstrategy._src.cluster import join
from jstrategy._src.cluster_resolver import ClusterResolver
from jstrategy._src.cluster_resolver import ClusterSpec
from jstrategy._src.cluster_resolver import ProcessLayout
from jstrategy._src.cluster_resolver import SimpleClusterResolver
from jstrategy._src.cluster_resolver import SlurmClusterResolver
from jstrategy._src.cluster_resolver import TFConfigClusterResolver
from jstrategy._src.cluster_resolver import training_process_layout
from jstrategy._src.tpu import TPUClusterResolver

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
