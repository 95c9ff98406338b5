"""factory-boy factories for the tests."""

from __future__ import annotations

import factory
from django.contrib.auth.models import Permission, User

from django_redlock.models import LockIncident


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.PostGenerationMethodCall("set_password", "secret")
    is_staff = True

    @factory.post_generation
    def perms(self, create: bool, extracted: list[str] | None, **kwargs: object) -> None:
        for codename in extracted or []:
            self.user_permissions.add(Permission.objects.get(codename=codename))
        self.save()


class LockIncidentFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = LockIncident

    kind = LockIncident.Kind.LOST
    name = factory.Sequence(lambda n: f"invoice:{n}")
    backend = "default"
    detail = "it expired"
