from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_redlock", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="Fence",
            fields=[
                ("key", models.CharField(max_length=64, primary_key=True, serialize=False)),
                ("backend", models.CharField(max_length=100)),
                ("name", models.CharField(max_length=1024, verbose_name="lock")),
                ("fence", models.BigIntegerField()),
                ("previous", models.BigIntegerField(blank=True, null=True)),
                ("touched", models.DateTimeField()),
            ],
            options={
                "verbose_name": "lock fence",
                "default_permissions": (),
            },
        ),
    ]
