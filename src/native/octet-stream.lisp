;;;; octet-stream.lisp -- a binary input stream over an octet vector: the
;;;; :RAW-BODY of a native request.

(in-package #:gallop)

(defclass octet-input-stream (sb-gray:fundamental-binary-input-stream)
  ((data :initarg :data :type (simple-array (unsigned-byte 8) (*)))
   (position :initform 0 :type fixnum))
  (:documentation "Reads the octets of DATA, then end of file."))

(defun make-octet-input-stream (data)
  (make-instance 'octet-input-stream :data data))

(defmethod stream-element-type ((s octet-input-stream))
  '(unsigned-byte 8))

(defmethod sb-gray:stream-read-byte ((s octet-input-stream))
  (with-slots (data position) s
    (if (< position (length data))
        (prog1 (aref data position) (incf position))
        :eof)))

(defmethod sb-gray:stream-read-sequence ((s octet-input-stream) sequence &optional (start 0) end)
  (with-slots (data position) s
    (let* ((end (or end (length sequence)))
           (n (min (- end start) (- (length data) position))))
      (replace sequence data :start1 start :end1 (+ start n) :start2 position)
      (incf position n)
      (+ start n))))

(defmethod sb-gray:stream-listen ((s octet-input-stream))
  (with-slots (data position) s
    (< position (length data))))
