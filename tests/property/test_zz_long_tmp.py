from hypothesis import settings, HealthCheck
import tests.property.test_rendezvous_machine as m
T = m.RendezvousMachine.TestCase
T.settings = settings(max_examples=3000, stateful_step_count=60, deadline=None, suppress_health_check=list(HealthCheck))
TestLong = T
