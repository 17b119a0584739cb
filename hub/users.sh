#!/usr/bin/env bash
# The accounts of a class, as root: ./hub/users.sh --instructors ada --students "bo cy dee"
#
# Each person gets a system user in the group course-instructors or course-students (the hub lets
# in these two groups, and makes instructors its admins), a home only they may enter (mode 0700:
# students cannot read each other's work), and a random password. The passwords go to a file only
# root may read (--passwords, default /root/course-hub-passwords), never to the screen or the
# repository: hand them out, or set each one yourself with passwd.
#   --remove    delete these users and their homes instead
set -euo pipefail
instructors="" students="" passwords=/root/course-hub-passwords remove=0
while [ $# -gt 0 ]; do
    case "$1" in
        --instructors) instructors="$2"; shift 2 ;;
        --students) students="$2"; shift 2 ;;
        --passwords) passwords="$2"; shift 2 ;;
        --remove) remove=1; shift ;;
        *) echo "unknown argument $1 (see the top of $0)" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "$0 creates system users: run it as root" >&2; exit 1; }
for group in course-instructors course-students; do
    getent group "$group" >/dev/null || groupadd "$group"
done
umask 077
touch "$passwords"
clear_tmp() {  # user: what the course keeps in /tmp under their id (clusters' folders)
    find /tmp -maxdepth 1 -user "$1" -name 'course_lib-*' -exec rm -rf {} + 2>/dev/null || true
}
add() {  # user group
    if [ "$remove" = 1 ]; then
        if id "$1" >/dev/null 2>&1; then
            for _ in 1 2 3 4 5 6 7 8 9 10; do   # their servers, kernels and engines
                pkill -KILL -u "$1" 2>/dev/null || break
                sleep 0.3
            done
            rmdir /sys/fs/cgroup/course-hub/"$1" /sys/fs/cgroup/memory/course-hub/"$1" \
                2>/dev/null || true  # their memory cgroup (hub/jupyterhub_config.py)
            clear_tmp "$1"
            userdel --remove "$1" 2>/dev/null || userdel "$1" || echo "could not remove $1" >&2
        fi
        sed -i "/^$1:/d" "$passwords"
        return
    fi
    if ! id "$1" >/dev/null 2>&1; then
        useradd --create-home --shell /bin/bash --gid "$2" "$1"
        clear_tmp "$1"  # a new user's id may be an earlier user's: inherit nothing of theirs
    fi
    usermod --append --groups "$2" "$1"
    chmod 0700 "$(getent passwd "$1" | cut -d: -f6)"
    local password
    password=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
    echo "$1:$password" | chpasswd
    sed -i "/^$1:/d" "$passwords"
    echo "$1:$password" >> "$passwords"
}
for user in $instructors; do add "$user" course-instructors; done
for user in $students; do add "$user" course-students; done
if [ "$remove" = 0 ]; then
    echo "users: $instructors (instructors) $students (students); passwords in $passwords"
fi
