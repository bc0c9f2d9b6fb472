;;;; pool.lisp -- overload as a client sees it: a 503 with Retry-After, not a
;;;; reset.  (The pool growing and shrinking under load:
;;;; tests/stress/pool.lisp.)

(in-package #:gallop-tests)

(def-suite pool :in gallop :description "Elastic worker pool and overload.")
(in-suite pool)

(defun open-requests (port count path)
  "Open COUNT connections to PORT and send GET PATH on each."
  (loop repeat count
        collect (let ((socket (connect port :timeout 30)))
                  (send socket (crlf (format nil "GET ~A HTTP/1.1" path) "Host: x"))
                  socket)))

(defun read-all-responses (sockets)
  "One response (or :CLOSED, or the error) per socket, then close them all."
  (unwind-protect
       (mapcar (lambda (socket)
                 (handler-case (or (read-response socket) :closed)
                   (error (e) e)))
               sockets)
    (mapc #'usocket:socket-close sockets)))

(defun sample-max (function until)
  "Call FUNCTION every 10 ms in a thread until UNTIL returns true; return the
largest value seen."
  (let ((best 0))
    (loop until (funcall until)
          do (setf best (max best (or (funcall function) 0)))
             (sleep 0.01))
    best))

(test overload-answers-503-with-retry-after-not-resets
  (with-globals ((*sleep-seconds* 1))
    (with-server (server 'gallop:easy-acceptor
                         :taskmaster (make-instance 'gallop:taskmaster
                                                    :max-thread-count 2
                                                    :standby-thread-count 2
                                                    :max-queue-length 2))
      (let* ((responses (read-all-responses (open-requests (port-of server) 20 "/sleep")))
             (ok (count-if (lambda (r) (and (response-p r) (= 200 (response-status r)))) responses))
             (busy (remove-if-not (lambda (r) (and (response-p r) (= 503 (response-status r))))
                                  responses)))
        (is (= 20 (+ ok (length busy))) "every client got an HTTP answer: ~S" responses)
        (is (<= 2 ok))
        (is (plusp (length busy)))
        (is (every (lambda (r) (header r "Retry-After")) busy))
        (is (= (length busy) (stat server :shed))))
      ;; and it still serves afterwards
      (is (= 200 (response-status (get-request (port-of server) "/yo")))))))
