"""The test suite.

Every port a test hands a server it starts comes from tests.ports, put in place of
procs.free_port here, before any test module imports it: outside the kernel's ephemeral range and
never handed out twice (procs.free_port's ports can be taken between the choice and the bind).
"""
from specdec.runtime import procs
from tests import ports

procs.free_port = ports.free_port
