#!/usr/bin/env bash
# Builds the image, creates the bucket and service account, and deploys
# sandboxd to Cloud Run.
#
#   deploy/deploy.sh PROJECT REGION BUCKET
#
# Needs gcloud (logged in, with rights to create buckets, service accounts and
# Cloud Run services) and Docker or Cloud Build.
set -euo pipefail
project=${1:?project}; region=${2:?region}; bucket=${3:?bucket}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
image="$region-docker.pkg.dev/$project/sandboxd/sandboxd:$(git -C "$repo" rev-parse --short HEAD)"
account="sandboxd@$project.iam.gserviceaccount.com"

gcloud services enable run.googleapis.com artifactregistry.googleapis.com cloudbuild.googleapis.com --project "$project"
gcloud artifacts repositories describe sandboxd --location "$region" --project "$project" >/dev/null 2>&1 \
  || gcloud artifacts repositories create sandboxd --repository-format docker --location "$region" --project "$project"

# One bucket for metadata, leases, checkpoints and snapshots; uniform access.
gcloud storage buckets describe "gs://$bucket" >/dev/null 2>&1 \
  || gcloud storage buckets create "gs://$bucket" --project "$project" --location "$region" --uniform-bucket-level-access
gcloud storage buckets update "gs://$bucket" --lifecycle-file "$here/bucket-lifecycle.json"

gcloud iam service-accounts describe "$account" --project "$project" >/dev/null 2>&1 \
  || gcloud iam service-accounts create sandboxd --project "$project" --display-name sandboxd
# Object read/write/delete on this bucket only (no bucket admin).
gcloud storage buckets add-iam-policy-binding "gs://$bucket" \
  --member "serviceAccount:$account" --role roles/storage.objectUser

gcloud builds submit "$repo" --project "$project" --tag "$image" --config /dev/stdin <<CLOUDBUILD
steps:
  - name: gcr.io/cloud-builders/docker
    # BuildKit: RUN --mount, and only the stages the image needs are built.
    env: ["DOCKER_BUILDKIT=1"]
    args: ["build", "-f", "deploy/Dockerfile", "-t", "$image", "."]
images: ["$image"]
CLOUDBUILD

sed -e "s|REGION-docker.pkg.dev/PROJECT/sandboxd/sandboxd:latest|$image|" \
    -e "s|PROJECT|$project|g" -e "s|BUCKET|$bucket|g" \
    "$here/cloudrun/service.yaml" > "$here/cloudrun/service.rendered.yaml"
gcloud run services replace "$here/cloudrun/service.rendered.yaml" --region "$region" --project "$project"
# Not public by default: anyone who can reach /create can run code. Grant
# roles/run.invoker to your clients' identities, or (a deliberate choice) to
# allUsers: gcloud run services add-iam-policy-binding sandboxd --member allUsers --role roles/run.invoker
# (then set SANDBOXD_CALLER_IDENTITY_VERIFIED to "false" in service.yaml:
# nobody checks the tokens of a public service).
url=$(gcloud run services describe sandboxd --region "$region" --project "$project" --format 'value(status.url)')
echo "deployed: ${url/https:/wss:}  (sandboxctl run --url ${url/https:/wss:} python 'print(1)')"
