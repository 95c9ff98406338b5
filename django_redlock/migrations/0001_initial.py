import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="HeldLock",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
            ],
            options={
                "verbose_name": "held lock",
                "verbose_name_plural": "held locks",
                "default_permissions": ("view",),
                "permissions": [("force_release", "Can force-release held locks")],
                "managed": False,
            },
        ),
        migrations.CreateModel(
            name="LockIncident",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("force_release", "forced release"),
                            ("lost", "hold lost"),
                            ("duplicate_skipped", "Celery duplicate skipped"),
                            ("acquire_timeout", "acquire timed out"),
                            ("quorum_failure", "quorum not reached"),
                        ],
                        db_index=True,
                        max_length=32,
                    ),
                ),
                ("name", models.CharField(max_length=1024, verbose_name="lock")),
                ("backend", models.CharField(db_index=True, max_length=100)),
                ("detail", models.TextField(blank=True)),
                ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                (
                    "user",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "verbose_name": "lock incident",
                "ordering": ["-created_at", "-id"],
            },
        ),
    ]
