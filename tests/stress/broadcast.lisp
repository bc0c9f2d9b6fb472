;;;; broadcast.lisp -- 900 WebSocket clients that never read, each sent
;;;; 16 KiB every 20 ms, with one GALLOP:WS-BROADCAST and with GALLOP:WS-SEND
;;;; to each (issue 63: the process died with its heap exhausted).  The
;;;; server runs in a child process (tests/child/broadcast-server.lisp).
;;;; Three rounds of 900 clients each; the server closes each client as its
;;;; backlog passes the send limit (1 MiB, or 64 KiB once memory is short),
;;;; and a fresh client asks for a page every 200 ms meanwhile.
;;;;
;;;; The bounds are the configured ones: the memory account's :OUTPUT never
;;;; past its limit; a broadcast's frames, shared, past one send limit's
;;;; worth plus the one frame each client being closed still holds; the
;;;; heap after a full collection, once the clients are gone, within 32 MB
;;;; of where it started (issue 63's bar for the attack rows).

(in-package #:gallop-tests)

(in-suite stress)

(defparameter *non-readers* 900)

(defun broadcast-child-stderr () "/tmp/gallop-broadcast-child.err")

(defun start-broadcast-child (mode)
  "Start tests/child/broadcast-server.lisp in MODE; the process and its port."
  (let* ((process (sb-ext:run-program
                   "scripts/lisp.sh" (list "--load" "tests/child/broadcast-server.lisp"
                                           "--end-toplevel-options" mode)
                   :search t :wait nil :input :stream :output :stream
                   :error (broadcast-child-stderr) :if-error-exists :supersede
                   :directory (asdf:system-source-directory "gallop")))
         (line (read-line (sb-ext:process-output process) nil "")))
    (values process (and (uiop:string-prefix-p "READY " line)
                         (parse-integer line :start 6)))))

(defun child-heap (process)
  (let ((answer (child-command process "gc")))
    (and (uiop:string-prefix-p "HEAP " answer)
         (parse-integer answer :start 5))))

(defun open-non-readers (port count)
  "COUNT WebSocket clients to PORT that send their handshake and never read,
opened 100 at a time."
  (let ((sockets '()))
    (loop while (< (length sockets) count)
          do (loop repeat (min 100 (- count (length sockets)))
                   do (let ((s (connect port :timeout 30)))
                        (send s (ws-handshake "/"))
                        (push s sockets)))
             (sleep 0.05))
    sockets))

(defun broadcast-round (process port)
  "One round: open the non-readers, probe with a fresh client every 200 ms
until the server closed them all (at most 60 s).  The probes' statuses,
and whether the server closed them all."
  (let ((sockets '())
        (statuses '())
        (done nil))
    (unwind-protect
         (let ((opener (sb-thread:make-thread
                        (lambda () (setf sockets (open-non-readers port *non-readers*)))
                        :name "non-readers")))
           (loop with deadline = (+ (get-internal-real-time) (* 60 internal-time-units-per-second))
                 until (or done (> (get-internal-real-time) deadline))
                 do (push (let ((r (ignore-errors (get-request port "/"))))
                            (if r (response-status r) :none))
                          statuses)
                    (sleep 0.2)
                    (unless (sb-thread:thread-alive-p opener)
                      (let ((stats (child-stats process)))
                        (setf done (and stats (zerop (getf stats :clients))))))))
      (mapc (lambda (s) (ignore-errors (usocket:socket-close s))) sockets))
    (values statuses done)))

(defun broadcast-to-non-readers (mode)
  (raise-fd-limit (+ 1000 (* 3 *non-readers*)))
  (multiple-value-bind (process port) (start-broadcast-child mode)
    (unwind-protect
         (progn
           (is (integerp port) "the ~A child did not start" mode)
           (let ((start-heap (child-heap process))
                 (statuses '()))
             (child-command process "reset")
             (dotimes (round 3)
               (multiple-value-bind (round-statuses done) (broadcast-round process port)
                 (is-true done "round ~D: the server did not close every client that does not read"
                     round)
                 (setf statuses (append round-statuses statuses))))
             (is (sb-ext:process-alive-p process) "the ~A child died: ~A" mode
                 (ignore-errors (uiop:read-file-string (broadcast-child-stderr))))
             (let* ((stats (child-stats process))
                    (frame (+ 4 (* 16 1024)))
                    (codes (getf stats :codes)))
               (is (every (lambda (s) (eql 200 s)) statuses)
                   "~D probes, not all answered 200: ~S" (length statuses)
                   (remove 200 statuses))
               (is (= (* 3 *non-readers*) (reduce #'+ codes :key #'cdr))
                   "ON-CLOSE codes: ~S" codes)
               ;; 1008 at the send limit; 1013 for one the overload manager
               ;; shed first; 1006 (no close frame) for one the minimum data
               ;; rate closed first (MIN-DATA-RATE-GRACE).
               (is (subsetp (mapcar #'car codes) '(1008 1013 1006)) "ON-CLOSE codes: ~S" codes)
               (is (<= (getf stats :peak-output) (getf stats :limit))
                   "queued output peaked at ~D, past the account's limit ~D"
                   (getf stats :peak-output) (getf stats :limit))
               (when (string= mode "broadcast")
                 (is (<= (getf stats :peak-output)
                         (+ (* 1024 1024) frame (* *non-readers* frame)))
                     "the broadcast's frames peaked at ~D octets" (getf stats :peak-output)))
               (let ((end-heap (child-heap process)))
                 (is (< (- end-heap start-heap) (* 32 1024 1024))
                     "heap after a full collection: ~D MB, then ~D MB"
                     (floor start-heap 1000000) (floor end-heap 1000000))
                 (format t "~&    ~A to ~D non-readers, 3 rounds: ~D probes; closed ~S; :output peaked ~
                            at ~,1F MB (limit ~,1F MB); heap after GC peaked at ~,1F MB; heap after a ~
                            full GC ~,1F MB, then ~,1F MB~%"
                         mode *non-readers* (length statuses) codes
                         (/ (getf stats :peak-output) 1e6) (/ (getf stats :limit) 1e6)
                         (/ (getf stats :peak-heap) 1e6) (/ start-heap 1e6) (/ end-heap 1e6))))))
      (ignore-errors (end-child-server process)))))

(test broadcast-to-900-non-readers-ws-broadcast
  "WS-BROADCAST of 16 KiB every 20 ms to 900 clients that never read: the
process lives, every fresh client is answered, each client is closed (1008
at its send limit), the frames are held once, the heap comes back."
  (broadcast-to-non-readers "broadcast"))

(test broadcast-to-900-non-readers-ws-send
  "The same with WS-SEND to each client: a copy each, so more is held, but
never past the memory account's limit (short of memory, the send limit
falls to 64 KiB), and the process lives."
  (broadcast-to-non-readers "send"))
