"""Checking objects against a CustomResourceDefinition's schema offline, as the API
server would (jsonschema on the version's openAPIV3Schema)."""
import copy


def closed_schema(schema: dict) -> dict:
    """The CRD schema with objects closed: the API server drops or rejects fields it does not
    know, except where the schema says x-kubernetes-preserve-unknown-fields."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for v in node.values():
                close(v)
        elif isinstance(node, list):
            for v in node:
                close(v)

    close(schema)
    return schema


def schema_errors(obj: dict, crd: dict) -> list[str]:
    """Every violation of the CRD's schema for obj's version (an empty list if none)."""
    import jsonschema

    names = crd["spec"]["names"]
    if obj.get("kind") != names["kind"] or obj.get("apiVersion", "").split("/")[0] != crd["spec"]["group"]:
        return [f"{obj.get('apiVersion')} {obj.get('kind')} is not a {crd['spec']['group']} {names['kind']}"]
    version = next((v for v in crd["spec"]["versions"] if v["name"] == obj["apiVersion"].split("/")[-1]), None)
    if version is None:
        return [f"{crd['spec']['group']} {names['kind']} has no version {obj['apiVersion'].split('/')[-1]!r}"]
    validator = jsonschema.Draft7Validator(closed_schema(version["schema"]["openAPIV3Schema"]))
    return [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]
