from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_redlock", "0003_fence_holder"),
    ]

    operations = [
        migrations.AddField(
            model_name="fence",
            name="mark",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="fence",
            name="previous_mark",
            field=models.BigIntegerField(blank=True, null=True),
        ),
    ]
