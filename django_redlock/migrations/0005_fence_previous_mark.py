from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_redlock", "0004_fence_mark"),
    ]

    operations = [
        migrations.AddField(
            model_name="fence",
            name="previous_mark",
            field=models.BigIntegerField(blank=True, null=True),
        ),
    ]
